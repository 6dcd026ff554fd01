import re

import pytest

from pcp_pd_kit.settings import ENV_KEYS, SettingsError, settings_from_env
from tests.support.env import example_env


def _with(**values: str) -> dict[str, str]:
    return {**example_env(), **values}


def test_every_knob_comes_from_env_example() -> None:
    """.env.example alone is a complete configuration: the settings hold no defaults."""
    env = example_env()
    assert set(ENV_KEYS) <= set(env)
    s = settings_from_env(env)
    assert s.proxy_port == int(env["LOCAL_PROXY_PORT"])
    assert s.block_size == int(env["CPU_BLOCK_SIZE"])
    assert s.prefill_cpus == env["PREFILL_CPUS"]


def test_a_knob_missing_from_every_layer_is_named() -> None:
    env = example_env()
    del env["CPU_BLOCK_SIZE"], env["LOCAL_PROXY_PORT"]
    with pytest.raises(
        SettingsError, match="not set: LOCAL_PROXY_PORT, CPU_BLOCK_SIZE. .env.example"
    ):
        settings_from_env(env)


def test_values_are_converted() -> None:
    s = settings_from_env(
        _with(
            LOCAL_PROXY_PORT="18555",
            LOCAL_ENFORCE_EAGER="no",
            CPU_PREFILL_PCP_SIZE="1",
            CPU_PREFILL_EXPERT_PARALLEL="0",
            LOCAL_STARTUP_TIMEOUT_S="12.5",
            PREFIX_CACHING="false",
        )
    )
    assert (s.proxy_port, s.enforce_eager, s.startup_timeout_s) == (18555, False, 12.5)
    assert s.prefix_caching is False and settings_from_env(_with()).prefix_caching is True
    assert (s.prefill_pcp_size, s.prefill_expert_parallel) == (1, False)


def test_empty_model_means_the_tiny_model() -> None:
    assert settings_from_env(_with(MODEL="", LOCAL_SERVED_MODEL_NAME="")).model == ""


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"LOCAL_PREFILL_PORT": "eighty"}, "LOCAL_PREFILL_PORT='eighty': expected an integer"),
        ({"LOCAL_ENFORCE_EAGER": "maybe"}, "LOCAL_ENFORCE_EAGER"),
        ({"PREFIX_CACHING": "sometimes"}, "PREFIX_CACHING='sometimes': expected one of"),
        ({"LOCAL_DECODE_PORT": "18100"}, "both use port 18100"),
        ({"CPU_BLOCK_SIZE": "24"}, "multiple of 16"),
        ({"CPU_PREFILL_PCP_SIZE": "0"}, "CPU_PREFILL_PCP_SIZE=0: must be >= 1"),
        ({"LOCAL_ENFORCE_EAGER": "0"}, "CPU_PREFILL_PCP_SIZE=2 needs LOCAL_ENFORCE_EAGER=1"),
        ({"PREFILL_CPUS": "0,1,2"}, "PREFILL_CPUS='0,1,2': 3 CPU(s) [0, 1, 2] cannot be split"),
        ({"NIXL_KV_LEASE_S": "5"}, "NIXL_KV_LEASE_S=5: must be >= 6"),
        ({"DECODE_CPUS": "one"}, "DECODE_CPUS='one': 'one': not a CPU list"),
        ({"CPU_BLOCK_SIZE": ""}, "CPU_BLOCK_SIZE is set but empty"),
        ({"KVCACHE_SPACE_GIB": "0"}, "KVCACHE_SPACE_GIB"),
        ({"LOCAL_PROXY_PORT": "70000"}, "outside 1-65535"),
        ({"LOCAL_STARTUP_TIMEOUT_S": "-1"}, "LOCAL_STARTUP_TIMEOUT_S must be > 0"),
        ({"KV_EXTRA_CONNECTORS": "[{"}, "KV_EXTRA_CONNECTORS is not JSON"),
        ({"PREFIX_CACHE_ROUTING": "always"}, "PREFIX_CACHE_ROUTING='always': expected one of"),
        (
            {"PREFIX_CACHE_ROUTING": "events", "PREFIX_CACHING": "false"},
            "PREFIX_CACHE_ROUTING=events needs PREFIX_CACHING=true",
        ),
        ({"LOCAL_HOST": "localhost"}, "LOCAL_HOST='localhost': must be an IPv4 address"),
        ({"LOCAL_DECODE_KV_REPLAY_PORT": "18200"}, "both use port 18200"),
        ({"KV_EXTRA_CONNECTORS": '[{"kv_connector":"X"}]'}, "KV_EXTRA_CONNECTORS[0] (X) needs"),
    ],
)
def test_bad_values_are_named(env: dict[str, str], message: str) -> None:
    with pytest.raises(SettingsError, match=re.escape(message)):
        settings_from_env(_with(**env))


def test_repository_env_example_names_the_kits_connector() -> None:
    """The stack must not fall back to stock NixlConnector (it ignores the CPU knobs)."""
    s = settings_from_env(example_env())
    assert (s.kv_connector, s.kv_connector_module_path) == (
        "PcpCanonicalNixlConnector",
        "pcp_nixl_connector",
    )
    assert s.host == "127.0.0.1"
    assert all(18000 <= port <= 18999 for port in s.ports().values())


@pytest.mark.parametrize("value", ["", "  "])
def test_empty_kv_connector_is_a_clear_error(value: str) -> None:
    with pytest.raises(SettingsError, match="KV_CONNECTOR is set but empty"):
        settings_from_env(_with(KV_CONNECTOR=value))
