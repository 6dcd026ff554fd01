"""The entrypoint's --kv-events-config (pd-proxy's cache index): built from KIT_KV_EVENTS_PORT
and KIT_KV_EVENTS_REPLAY_PORT with wildcard binds, only with prefix caching on, and checked
against vLLM's own config class (the field names the installed vLLM reads)."""

from __future__ import annotations

import json

import pytest
from vllm_serve import command
from vllm_serve import main as entry

from tests.entrypoint.loader import main_env

BASE = {
    "KIT_KV_CONNECTOR": "PcpCanonicalNixlConnector",
    "KIT_KV_CONNECTOR_MODULE_PATH": "pcp_nixl_connector",
    "KIT_KV_ROLE": "kv_consumer",
}
EVENTS = {**BASE, "KIT_KV_EVENTS_PORT": "5557", "KIT_KV_EVENTS_REPLAY_PORT": "5558"}


def events_config(cmd: list[str]) -> dict[str, object] | None:
    if "--kv-events-config" not in cmd:
        return None
    return dict(json.loads(cmd[cmd.index("--kv-events-config") + 1]))


def test_the_ports_give_a_wildcard_publisher_and_replay_vllm_accepts() -> None:
    cmd = command.vllm_command(["--model", "m"], EVENTS, "python3")
    config = events_config(cmd)
    assert config == {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": "tcp://*:5557",
        "replay_endpoint": "tcp://*:5558",
        "topic": "kv",
    }
    assert cmd[-2] == "--kv-transfer-config"  # still last: the start-up line prints cmd[-1]
    from vllm.config.kv_events import KVEventsConfig

    parsed = KVEventsConfig(**config)  # unknown or misspelt fields raise here
    assert parsed.enable_kv_cache_events and parsed.endpoint == "tcp://*:5557"


def test_without_a_replay_port_only_the_publisher() -> None:
    env = {k: v for k, v in EVENTS.items() if k != "KIT_KV_EVENTS_REPLAY_PORT"}
    config = events_config(command.vllm_command([], env, "python3"))
    assert config is not None and "replay_endpoint" not in config


@pytest.mark.parametrize(
    ("env", "argv"),
    [
        ({"KIT_PREFIX_CACHING": "false"}, []),  # the cpu profile's switch
        ({}, ["--no-enable-prefix-caching"]),  # a GPU server's VLLM_EXTRA_ARGS
        ({}, ["--enable-prefix-caching", "--no_enable_prefix_caching"]),  # the last one wins
    ],
)
def test_no_events_when_prefix_caching_is_off(env: dict[str, str], argv: list[str]) -> None:
    assert events_config(command.vllm_command(argv, {**EVENTS, **env}, "python3")) is None


@pytest.mark.parametrize(
    ("env", "argv"),
    [({"KIT_PREFIX_CACHING": "true"}, []), ({}, []), ({}, ["--enable-prefix-caching"])],
)
def test_events_when_prefix_caching_is_on_or_vllms_default(
    env: dict[str, str], argv: list[str]
) -> None:
    assert events_config(command.vllm_command(argv, {**EVENTS, **env}, "python3")) is not None


def test_a_topic_of_its_own() -> None:
    """llm-d's router names each pod in the topic (its kv-events-patch.yaml)."""
    env = {**EVENTS, "KIT_KV_EVENTS_TOPIC": "kv@10.0.0.7:8000@m"}
    config = events_config(command.vllm_command([], env, "python3"))
    assert config is not None and config["topic"] == "kv@10.0.0.7:8000@m"


def test_no_port_no_events() -> None:
    assert events_config(command.vllm_command([], BASE, "python3")) is None


@pytest.mark.parametrize(
    ("change", "argv", "needle"),
    [
        ({"KIT_KV_EVENTS_PORT": "55x"}, [], "KIT_KV_EVENTS_PORT='55x' \\(KV_EVENTS_PORT\\)"),
        ({"KIT_KV_EVENTS_PORT": "70000"}, [], "want a TCP port"),
        ({"KIT_KV_EVENTS_REPLAY_PORT": "5557"}, [], "both 5557: want two ports"),
        ({"KIT_KV_EVENTS_PORT": ""}, [], "REPLAY_PORT is set without KIT_KV_EVENTS_PORT"),
        ({}, ["--kv-events-config", "{}"], "--kv-events-config is in the arguments"),
        ({}, ["--kv_events_config.topic=x"], "--kv-events-config is in the arguments"),
    ],
)
def test_bad_settings_are_refused(change: dict[str, str], argv: list[str], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        command.vllm_command(argv, {**EVENTS, **change}, "python3")


def test_main_prints_the_events_config(monkeypatch, tmp_path, capsys) -> None:
    main_env(monkeypatch, tmp_path, EVENTS)
    monkeypatch.setattr(entry, "supervise", lambda cmd, env, **kw: 0)
    with pytest.raises(SystemExit):
        entry.main(["--port", "8200"])
    assert '--kv-events-config {"enable_kv_cache_events":true' in capsys.readouterr().out
