"""Cache-aware routing wired in compose, as the pinned `docker compose config` renders it (both
profiles): every vLLM server publishes KV events on the .env.example ports with a wildcard bind
(on the compose network only), only with prefix caching on; the proxy reads the served model's
tokenizer from the servers' own model files, mounted read-only."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.compose import checks as cc
from tests.compose import compose_cli as cli

PROFILES = {"gpu": (), "cpu": ("cpu",)}


def render(tmp_path: Path, overrides: dict[str, str], profile: str) -> dict[str, Any]:
    return cli.config(env_file=cli.env_file(tmp_path, overrides), profiles=PROFILES[profile])


def events(service: dict[str, Any]) -> dict[str, Any] | None:
    raw = cc.flag_value(cc.exec_argv(service), "--kv-events-config")
    return None if raw is None else dict(json.loads(raw))


@pytest.mark.parametrize("profile", PROFILES)
def test_every_server_publishes_kv_events_on_the_env_example_ports(
    tmp_path: Path, profile: str, env_example: dict[str, str]
) -> None:
    model = render(tmp_path, {}, profile)
    servers = cc.vllm_services(model)
    assert len(servers) == 2
    port, replay = env_example["KV_EVENTS_PORT"], env_example["KV_EVENTS_REPLAY_PORT"]
    for name, service in servers.items():
        assert events(service) == {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{port}",  # a bind: vLLM connects for a concrete host
            "replay_endpoint": f"tcp://*:{replay}",
            "topic": "kv",
        }, name
    # Never on the host: only the proxy (and monitoring on loopback) is published.
    ports = {p for rows in cc.published(model).values() for _, p in rows}
    assert not {int(port), int(replay)} & ports, cc.published(model)
    assert not any(cc.published(model).get(name) for name in servers)


@pytest.mark.parametrize("profile", PROFILES)
def test_other_ports_reach_the_servers(tmp_path: Path, profile: str) -> None:
    model = render(tmp_path, {"KV_EVENTS_PORT": "6557", "KV_EVENTS_REPLAY_PORT": "6558"}, profile)
    for service in cc.vllm_services(model).values():
        cfg = events(service)
        assert cfg is not None and cfg["endpoint"] == "tcp://*:6557"
        assert cfg["replay_endpoint"] == "tcp://*:6558"


def test_no_events_with_prefix_caching_off_or_no_port(tmp_path: Path) -> None:
    off = render(tmp_path, {"PREFIX_CACHING": "false"}, "cpu")
    assert [events(s) for s in cc.vllm_services(off).values()] == [None, None]
    gpu_off = render(tmp_path, {"VLLM_EXTRA_ARGS": "--no-enable-prefix-caching"}, "gpu")
    assert [events(s) for s in cc.vllm_services(gpu_off).values()] == [None, None]
    none = render(tmp_path, {"KV_EVENTS_PORT": "", "KV_EVENTS_REPLAY_PORT": ""}, "cpu")
    assert [events(s) for s in cc.vllm_services(none).values()] == [None, None]


def volume(service: dict[str, Any], target: str) -> dict[str, Any]:
    (found,) = [v for v in service.get("volumes") or [] if v.get("target") == target]
    return dict(found)


def test_the_cpu_proxy_reads_the_cpu_servers_model_folder(env_example: dict[str, str]) -> None:
    model = cli.config(profiles=["cpu"])
    proxy = model["services"]["proxy-cpu"]
    server = model["services"]["decode-cpu"]
    assert cc.environment(proxy)["PD_PROXY_TOKENIZER"] == env_example["CPU_MODEL"]
    assert cc.flag_value(cc.command_args(server), "--model") == env_example["CPU_MODEL"]
    mount = volume(proxy, "/models")
    assert mount["read_only"] is True
    assert mount["source"] == volume(server, "/models")["source"]
    # The proxy keeps the rest of its settings (the YAML merge replaced only these two keys).
    assert cc.environment(proxy)["PD_PROXY_DECODE_DNS"] == "decode:8200"
    assert volume(proxy, "/run/kit-keys")["read_only"] is True


def test_the_gpu_proxy_finds_the_model_id_in_the_servers_hf_cache(
    env_example: dict[str, str],
) -> None:
    model = cli.config()
    proxy, server = model["services"]["proxy"], model["services"]["decode"]
    env = cc.environment(proxy)
    assert env["PD_PROXY_TOKENIZER"] == env_example["MODEL_NAME"]
    assert cc.flag_value(cc.command_args(server), "--model") == env_example["MODEL_NAME"]
    mount = volume(proxy, env["HF_HOME"])
    assert mount["read_only"] is True
    hf = cc.environment(server)["HF_HOME"]
    assert mount["source"] == volume(server, hf)["source"]
