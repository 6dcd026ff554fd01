"""Typed, validated stack settings drawn from the layered env (see envfile.layered_env).

Every knob has a default matching the `# --- Local CPU stack` section of .env.example, so the
stack also runs when that section is missing; a malformed value fails here, with its name,
before any process starts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields


class SettingsError(ValueError):
    """An env value the stack cannot use."""


@dataclass(frozen=True)
class StackSettings:
    host: str = "127.0.0.1"
    proxy_port: int = 18000
    prefill_port: int = 18100
    decode_port: int = 18200
    reference_port: int = 18300
    prometheus_port: int = 18090
    prefill_side_channel_port: int = 18101
    decode_side_channel_port: int = 18201
    model: str = ""
    served_model_name: str = ""
    max_model_len: int = 4096
    block_size: int = 32
    dtype: str = "auto"
    enforce_eager: bool = True
    kvcache_space_gib: int = 1
    prefill_cpu_bind: str = "0"
    decode_cpu_bind: str = "1"
    nixl_progress_delay_us: int = 1000
    # The kit's connector: stock NixlConnector ignores the CPU knobs (22-112 s per request).
    kv_connector: str = "PcpCanonicalNixlConnector"
    kv_connector_module_path: str = "pcp_nixl_connector"
    startup_timeout_s: float = 600.0
    prometheus_scrape_interval_s: float = 2.0
    demo_limit: int = 4
    demo_expected_score: str = "0.0"

    def ports(self) -> dict[str, int]:
        """Every port the stack binds, by the name used in error messages."""
        return {
            "proxy": self.proxy_port,
            "prefill": self.prefill_port,
            "decode": self.decode_port,
            "prometheus": self.prometheus_port,
            "prefill NIXL side channel": self.prefill_side_channel_port,
            "decode NIXL side channel": self.decode_side_channel_port,
        }

    def url(self, port: int) -> str:
        return f"http://{self.host}:{port}"


# env var -> field name. MODEL and the connector names are shared with the compose stack.
ENV_KEYS: dict[str, str] = {
    "LOCAL_HOST": "host",
    "LOCAL_PROXY_PORT": "proxy_port",
    "LOCAL_PREFILL_PORT": "prefill_port",
    "LOCAL_DECODE_PORT": "decode_port",
    "LOCAL_PROMETHEUS_PORT": "prometheus_port",
    "LOCAL_PREFILL_SIDE_CHANNEL_PORT": "prefill_side_channel_port",
    "LOCAL_DECODE_SIDE_CHANNEL_PORT": "decode_side_channel_port",
    "MODEL": "model",
    "LOCAL_SERVED_MODEL_NAME": "served_model_name",
    "MAX_MODEL_LEN": "max_model_len",
    "CPU_BLOCK_SIZE": "block_size",
    "LOCAL_DTYPE": "dtype",
    "LOCAL_ENFORCE_EAGER": "enforce_eager",
    "KVCACHE_SPACE_GIB": "kvcache_space_gib",
    "PREFILL_CPUS": "prefill_cpu_bind",
    "DECODE_CPUS": "decode_cpu_bind",
    "NIXL_PROGRESS_DELAY_US": "nixl_progress_delay_us",
    "KV_CONNECTOR": "kv_connector",
    "KV_CONNECTOR_MODULE_PATH": "kv_connector_module_path",
    "LOCAL_STARTUP_TIMEOUT_S": "startup_timeout_s",
    "LOCAL_PROMETHEUS_SCRAPE_INTERVAL_S": "prometheus_scrape_interval_s",
    "DEMO_LIMIT": "demo_limit",
    "DEMO_EXPECTED_SCORE": "demo_expected_score",
}
# Keys whose empty value is an error rather than "use the default": an empty KV_CONNECTOR most
# likely means a broken .env, and silently picking any connector would hide that.
REQUIRED_IF_SET: dict[str, str] = {
    "KV_CONNECTOR": (
        "KV_CONNECTOR is set but empty: set it to PcpCanonicalNixlConnector (with "
        "KV_CONNECTOR_MODULE_PATH=pcp_nixl_connector), or unset it for that default"
    ),
}
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _convert(env_key: str, raw: str, kind: type) -> object:
    value = raw.strip()
    if kind is bool:
        if value.lower() in _TRUE:
            return True
        if value.lower() in _FALSE:
            return False
        raise SettingsError(f"{env_key}={raw!r}: expected one of 1/0/true/false/yes/no")
    if kind is int:
        try:
            return int(value)
        except ValueError:
            raise SettingsError(f"{env_key}={raw!r}: expected an integer") from None
    if kind is float:
        try:
            return float(value)
        except ValueError:
            raise SettingsError(f"{env_key}={raw!r}: expected a number") from None
    return value


def settings_from_env(env: Mapping[str, str]) -> StackSettings:
    """Build and validate settings; keys absent or empty in env keep their defaults.

    Except KV_CONNECTOR: set but empty is a SettingsError (see REQUIRED_IF_SET).
    """
    kinds = {f.name: f.type for f in fields(StackSettings)}
    type_of = {"int": int, "float": float, "bool": bool, "str": str}
    values: dict[str, object] = {}
    for env_key, field_name in ENV_KEYS.items():
        raw = env.get(env_key)
        if env_key in REQUIRED_IF_SET and raw is not None and not raw.strip():
            raise SettingsError(REQUIRED_IF_SET[env_key])
        if raw is None or not raw.strip():
            continue
        kind = type_of[str(kinds[field_name])]
        values[field_name] = _convert(env_key, raw, kind)
    settings = StackSettings(**values)  # type: ignore[arg-type]
    validate(settings)
    return settings


def validate(s: StackSettings) -> None:
    """Reject values that would only fail later inside a server log."""
    ports = s.ports()
    for name, port in ports.items():
        if not 1 <= port <= 65535:
            raise SettingsError(f"{name} port {port} is outside 1-65535")
    seen: dict[int, str] = {}
    for name, port in ports.items():
        if port in seen:
            raise SettingsError(f"{name} and {seen[port]} both use port {port}")
        seen[port] = name
    if s.block_size <= 0 or s.block_size % 32:
        raise SettingsError(
            f"CPU_BLOCK_SIZE={s.block_size}: vLLM's CPU attention needs a multiple of 32"
        )
    if s.kvcache_space_gib < 1:
        raise SettingsError("KVCACHE_SPACE_GIB must be at least 1 (GiB)")
    if s.max_model_len < s.block_size:
        raise SettingsError("MAX_MODEL_LEN must be at least one block")
    if s.nixl_progress_delay_us < 0:
        raise SettingsError("NIXL_PROGRESS_DELAY_US must be >= 0")
    for name in ("startup_timeout_s", "prometheus_scrape_interval_s"):
        if getattr(s, name) <= 0:
            env_key = next(k for k, v in ENV_KEYS.items() if v == name)
            raise SettingsError(f"{env_key} must be > 0")
    if not s.kv_connector:
        raise SettingsError("KV_CONNECTOR is empty")
    if s.demo_limit < 1:
        raise SettingsError("DEMO_LIMIT must be >= 1")
