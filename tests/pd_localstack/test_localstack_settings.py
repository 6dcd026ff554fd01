import pytest
from pd_localstack.envfile import layered_env
from pd_localstack.paths import repo_root
from pd_localstack.settings import SettingsError, StackSettings, settings_from_env


def test_empty_env_gives_defaults() -> None:
    assert settings_from_env({}) == StackSettings()


def test_values_are_converted_and_empty_values_keep_defaults() -> None:
    s = settings_from_env(
        {
            "LOCAL_PROXY_PORT": "18555",
            "LOCAL_ENFORCE_EAGER": "no",
            "LOCAL_STARTUP_TIMEOUT_S": "12.5",
            "MODEL": "",
            "CPU_BLOCK_SIZE": "",
        }
    )
    assert (s.proxy_port, s.enforce_eager, s.startup_timeout_s) == (18555, False, 12.5)
    assert s.block_size == StackSettings().block_size


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"LOCAL_PREFILL_PORT": "eighty"}, "LOCAL_PREFILL_PORT='eighty': expected an integer"),
        ({"LOCAL_ENFORCE_EAGER": "maybe"}, "LOCAL_ENFORCE_EAGER"),
        ({"LOCAL_DECODE_PORT": "18100"}, "both use port 18100"),
        ({"CPU_BLOCK_SIZE": "16"}, "multiple of 32"),
        ({"KVCACHE_SPACE_GIB": "0"}, "KVCACHE_SPACE_GIB"),
        ({"LOCAL_PROXY_PORT": "70000"}, "outside 1-65535"),
        ({"LOCAL_STARTUP_TIMEOUT_S": "-1"}, "LOCAL_STARTUP_TIMEOUT_S must be > 0"),
    ],
)
def test_bad_values_are_named(env: dict[str, str], message: str) -> None:
    with pytest.raises(SettingsError, match=message.replace("(", r"\(")):
        settings_from_env(env)


def test_repository_env_example_is_valid_and_names_the_kits_connector() -> None:
    s = settings_from_env(layered_env(repo_root(), {}))
    assert s.kv_connector == "PcpCanonicalNixlConnector"
    assert s.kv_connector_module_path == "pcp_nixl_connector"
    assert s.host == "127.0.0.1"
    assert all(18000 <= port <= 18999 for port in s.ports().values())


def test_default_connector_is_the_kits_own() -> None:
    """Without KV_CONNECTOR the stack must not fall back to stock NixlConnector (no CPU knobs)."""
    s = settings_from_env({})
    assert (s.kv_connector, s.kv_connector_module_path) == (
        "PcpCanonicalNixlConnector",
        "pcp_nixl_connector",
    )


@pytest.mark.parametrize("value", ["", "  "])
def test_empty_kv_connector_is_a_clear_error(value: str) -> None:
    with pytest.raises(SettingsError, match="KV_CONNECTOR is set but empty"):
        settings_from_env({"KV_CONNECTOR": value})
