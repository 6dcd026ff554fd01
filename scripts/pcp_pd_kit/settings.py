"""The kit's settings: one env loader and the local stack's typed settings.

Env files are layered .env.example < .env < process environment, so a knob set once in .env
applies to compose (which reads .env itself), the local stack and the eval alike, and `MODEL=...
make demo` works without editing files. .env.example is the only place a default lives: a knob
missing from every layer is an error naming it, not a silent fallback. python-dotenv parses; it
only warns about a line it cannot parse, and a setting silently dropped is worse than a clear
error, so every such line is an error here. A malformed value fails here, with its name, before
any process starts.
"""

from __future__ import annotations

import io
import ipaddress
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path

from dotenv.parser import parse_stream

from pcp_nixl_connector.cpu_compat.binding import omp_threads_bind, parse_cpu_list
from pcp_nixl_connector.extra_connectors import parse_extra_connectors
from pcp_pd_kit import repo_root
from pd_proxy.config import CACHE_ROUTING_MODES
from pd_proxy.timeouts import KIT_NAMES, ProxyLimits, timeout_problems
from pd_proxy.tracing import PROTOCOLS as OTLP_PROTOCOLS

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class EnvFileError(ValueError):
    """A line in an env file that is not KEY=VALUE."""


def parse_env_text(text: str, source: str = "<env>") -> dict[str, str]:
    """KEY=VALUE lines (comments, `export`, quotes as Compose reads them); no interpolation."""
    values: dict[str, str] = {}
    for binding in parse_stream(io.StringIO(text)):
        if binding.key is None and not binding.error:
            continue  # blank line or comment
        line = binding.original.line
        stripped = binding.original.string.strip()
        key = binding.key
        if binding.error or binding.value is None or key is None or not _NAME.fullmatch(key):
            raise EnvFileError(f"{source}: line {line}: expected KEY=VALUE, got {stripped!r}")
        values[key] = binding.value
    return values


def read_env_file(path: Path) -> dict[str, str]:
    """The parsed file, or {} when it does not exist (.env is optional)."""
    if not path.is_file():
        return {}
    return parse_env_text(path.read_text(encoding="utf-8"), source=str(path))


def merged_env(files: Sequence[Path], environ: Mapping[str, str]) -> dict[str, str]:
    """The files in order (missing ones skipped), then the process environment, later wins."""
    merged: dict[str, str] = {}
    for path in files:
        merged.update(read_env_file(path))
    merged.update(environ)
    return merged


def kit_env(environ: Mapping[str, str], root: Path | None = None) -> dict[str, str]:
    """.env.example < .env < process environment (``root``: the checkout), as one flat mapping:
    what every kit command reads its settings from.

    KIT_DOTENV names another file to read instead of .env; set but empty, none is read (the test
    suite does that, so a developer's own .env never changes what the tests see).
    """
    root = root or repo_root()
    override = environ.get("KIT_DOTENV")
    files = [root / ".env.example"]
    if override is None:
        files.append(root / ".env")
    elif override:
        files.append(Path(override))
    return merged_env(files, environ)


class SettingsError(ValueError):
    """An env value the stack cannot use."""


@dataclass(frozen=True)
class StackSettings:
    """The local stack's knobs, typed; built only by settings_from_env (no defaults here)."""

    host: str
    proxy_port: int
    prefill_port: int
    decode_port: int
    reference_port: int
    prometheus_port: int
    prefill_side_channel_port: int
    decode_side_channel_port: int
    prefill_kv_events_port: int
    prefill_kv_replay_port: int
    decode_kv_events_port: int
    decode_kv_replay_port: int
    model: str
    served_model_name: str
    max_model_len: int
    block_size: int
    dtype: str
    enforce_eager: bool
    kvcache_space_gib: int
    prefill_cpus: str
    decode_cpus: str
    prefill_pcp_size: int
    prefill_expert_parallel: bool
    attention_backend: str
    prefix_caching: bool
    prefix_cache_routing: str
    nixl_progress_delay_us: int
    nixl_early_kv_load: bool
    kv_lease_s: int
    proxy_connect_timeout_s: float
    proxy_prefill_timeout_s: float
    proxy_decode_timeout_s: float
    local_prefill_max_tokens: int
    admission: bool
    prefill_max_inflight: int
    prefill_max_tokens: int
    decode_max_inflight: int
    decode_max_pending_pulls: int
    queue_size: int
    queue_timeout_s: float
    flow_header: str
    client_priority: bool
    api_key_file: str
    otlp_traces_endpoint: str
    otlp_traces_protocol: str
    eval_request_timeout_s: float
    kv_connector: str
    kv_connector_module_path: str
    kv_extra_connectors: str
    startup_timeout_s: float
    prometheus_scrape_interval_s: float
    demo_limit: int
    demo_expected_score: str

    def ports(self) -> dict[str, int]:
        """Every port the stack binds, by the name used in error messages."""
        return {
            "proxy": self.proxy_port,
            "prefill": self.prefill_port,
            "decode": self.decode_port,
            "prometheus": self.prometheus_port,
            "prefill NIXL side channel": self.prefill_side_channel_port,
            "decode NIXL side channel": self.decode_side_channel_port,
            "prefill KV events": self.prefill_kv_events_port,
            "prefill KV events replay": self.prefill_kv_replay_port,
            "decode KV events": self.decode_kv_events_port,
            "decode KV events replay": self.decode_kv_replay_port,
        }

    def url(self, port: int) -> str:
        return f"http://{self.host}:{port}"


# env var -> field name. MODEL and the connector names are shared with the compose stack.
ENV_KEYS: dict[str, str] = {
    "LOCAL_HOST": "host",
    "LOCAL_PROXY_PORT": "proxy_port",
    "LOCAL_PREFILL_PORT": "prefill_port",
    "LOCAL_DECODE_PORT": "decode_port",
    "LOCAL_REFERENCE_PORT": "reference_port",
    "LOCAL_PROMETHEUS_PORT": "prometheus_port",
    "LOCAL_PREFILL_SIDE_CHANNEL_PORT": "prefill_side_channel_port",
    "LOCAL_DECODE_SIDE_CHANNEL_PORT": "decode_side_channel_port",
    "LOCAL_PREFILL_KV_EVENTS_PORT": "prefill_kv_events_port",
    "LOCAL_PREFILL_KV_REPLAY_PORT": "prefill_kv_replay_port",
    "LOCAL_DECODE_KV_EVENTS_PORT": "decode_kv_events_port",
    "LOCAL_DECODE_KV_REPLAY_PORT": "decode_kv_replay_port",
    "MODEL": "model",
    "LOCAL_SERVED_MODEL_NAME": "served_model_name",
    "MAX_MODEL_LEN": "max_model_len",
    "CPU_BLOCK_SIZE": "block_size",
    "CPU_DTYPE": "dtype",
    "LOCAL_ENFORCE_EAGER": "enforce_eager",
    "KVCACHE_SPACE_GIB": "kvcache_space_gib",
    "PREFILL_CPUS": "prefill_cpus",
    "DECODE_CPUS": "decode_cpus",
    "CPU_PREFILL_PCP_SIZE": "prefill_pcp_size",
    "CPU_PREFILL_EXPERT_PARALLEL": "prefill_expert_parallel",
    "CPU_ATTENTION_BACKEND": "attention_backend",
    "PREFIX_CACHING": "prefix_caching",
    "PREFIX_CACHE_ROUTING": "prefix_cache_routing",
    "NIXL_PROGRESS_DELAY_US": "nixl_progress_delay_us",
    "NIXL_EARLY_KV_LOAD": "nixl_early_kv_load",
    "NIXL_KV_LEASE_S": "kv_lease_s",
    "PROXY_CONNECT_TIMEOUT_S": "proxy_connect_timeout_s",
    "PROXY_PREFILL_TIMEOUT_S": "proxy_prefill_timeout_s",
    "PROXY_DECODE_TIMEOUT_S": "proxy_decode_timeout_s",
    "LOCAL_PREFILL_MAX_TOKENS": "local_prefill_max_tokens",
    # Admission: the switch, timeout, flow header and priority are every stack's; the limits are
    # the CPU ones (the compose cpu profile reads the same).
    "PROXY_ADMISSION": "admission",
    "CPU_PROXY_PREFILL_MAX_INFLIGHT": "prefill_max_inflight",
    "CPU_PROXY_PREFILL_MAX_TOKENS": "prefill_max_tokens",
    "CPU_PROXY_DECODE_MAX_INFLIGHT": "decode_max_inflight",
    "CPU_PROXY_DECODE_MAX_PENDING_PULLS": "decode_max_pending_pulls",
    "CPU_PROXY_QUEUE_SIZE": "queue_size",
    "PROXY_QUEUE_TIMEOUT_S": "queue_timeout_s",
    "PROXY_FLOW_HEADER": "flow_header",
    "PROXY_CLIENT_PRIORITY": "client_priority",
    "LOCAL_API_KEY_FILE": "api_key_file",
    # Request tracing, every stack's (OpenTelemetry's own names): empty endpoint, off.
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "otlp_traces_endpoint",
    "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "otlp_traces_protocol",
    "EVAL_REQUEST_TIMEOUT_S": "eval_request_timeout_s",
    "KV_CONNECTOR": "kv_connector",
    "KV_CONNECTOR_MODULE_PATH": "kv_connector_module_path",
    "KV_EXTRA_CONNECTORS": "kv_extra_connectors",
    "LOCAL_STARTUP_TIMEOUT_S": "startup_timeout_s",
    "LOCAL_PROMETHEUS_SCRAPE_INTERVAL_S": "prometheus_scrape_interval_s",
    "DEMO_LIMIT": "demo_limit",
    "DEMO_EXPECTED_SCORE": "demo_expected_score",
}
# Keys whose empty value means something (the tiny model; the served name derived from the model;
# no extra KV connectors; no flow header; no client key; no tracing).
# Any other knob set empty most likely means a broken .env, and guessing would hide that.
MAY_BE_EMPTY = frozenset(
    {
        "MODEL",
        "LOCAL_SERVED_MODEL_NAME",
        "KV_EXTRA_CONNECTORS",
        "PROXY_FLOW_HEADER",
        "LOCAL_API_KEY_FILE",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    }
)
# The variable pd-proxy reads its client key file from: set in the environment of `make up` with
# LOCAL_API_KEY_FILE empty, it is the local stack's key file (the proxy would read it anyway).
PROXY_KEY_FILE_VARIABLE = "PD_PROXY_API_KEY_FILE"
# The admission limits per replica, where 0 means none.
ADMISSION_COUNTS = {
    "CPU_PROXY_PREFILL_MAX_INFLIGHT": "prefill_max_inflight",
    "CPU_PROXY_PREFILL_MAX_TOKENS": "prefill_max_tokens",
    "CPU_PROXY_DECODE_MAX_INFLIGHT": "decode_max_inflight",
    "CPU_PROXY_DECODE_MAX_PENDING_PULLS": "decode_max_pending_pulls",
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
    """Build and validate settings from the layered env (kit_env), which must hold every knob."""
    kinds = {f.name: f.type for f in fields(StackSettings)}
    type_of = {"int": int, "float": float, "bool": bool, "str": str}
    missing = [key for key in ENV_KEYS if key not in env]
    if missing:
        raise SettingsError(
            f"not set: {', '.join(missing)}. .env.example holds every knob's default; restore "
            "it from git (or set these in .env)"
        )
    values: dict[str, object] = {}
    for env_key, field_name in ENV_KEYS.items():
        raw = env[env_key]
        if not raw.strip() and env_key not in MAY_BE_EMPTY:
            raise SettingsError(f"{env_key} is set but empty: set a value or unset it in .env")
        kind = type_of[str(kinds[field_name])]
        values[field_name] = _convert(env_key, raw, kind)
    if not values["api_key_file"]:
        values["api_key_file"] = env.get(PROXY_KEY_FILE_VARIABLE, "").strip()
    settings = StackSettings(**values)  # type: ignore[arg-type]
    validate(settings)
    return settings


def proxy_limits(s: StackSettings) -> ProxyLimits:
    """The local proxy's limits (pd_proxy.timeouts), as commands.proxy_spec passes them."""
    return ProxyLimits(
        s.proxy_connect_timeout_s, s.proxy_prefill_timeout_s, s.proxy_decode_timeout_s
    )


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
    if s.block_size <= 0 or s.block_size % 16:
        raise SettingsError(
            f"CPU_BLOCK_SIZE={s.block_size}: vLLM's CPU attention needs a multiple of 16 "
            "(16 for MLA models, which the CPU MLA kernels force)"
        )
    if s.prefill_pcp_size < 1:
        raise SettingsError(f"CPU_PREFILL_PCP_SIZE={s.prefill_pcp_size}: must be >= 1")
    if s.prefill_pcp_size > 1 and not s.enforce_eager:
        raise SettingsError(
            f"CPU_PREFILL_PCP_SIZE={s.prefill_pcp_size} needs LOCAL_ENFORCE_EAGER=1: PCP on CPU "
            "runs Model Runner V2's Triton kernels in Triton's interpreter, which torch.compile "
            "cannot compile"
        )
    for env_key, cpus, ranks in (
        ("PREFILL_CPUS", s.prefill_cpus, s.prefill_pcp_size),
        ("DECODE_CPUS", s.decode_cpus, 1),
    ):
        try:
            omp_threads_bind(parse_cpu_list(cpus), ranks)
        except ValueError as exc:
            raise SettingsError(f"{env_key}={cpus!r}: {exc}") from None
    if s.kvcache_space_gib < 1:
        raise SettingsError("KVCACHE_SPACE_GIB must be at least 1 (GiB)")
    if s.max_model_len < s.block_size:
        raise SettingsError("MAX_MODEL_LEN must be at least one block")
    if s.local_prefill_max_tokens < 0:
        raise SettingsError("LOCAL_PREFILL_MAX_TOKENS must be >= 0 (0: every request P/D)")
    for env_key, field_name in ADMISSION_COUNTS.items():
        if getattr(s, field_name) < 0:
            raise SettingsError(f"{env_key} must be >= 0 (0: no limit)")
    if s.queue_size < 0:
        raise SettingsError("CPU_PROXY_QUEUE_SIZE must be >= 0 (0: refuse when there is no room)")
    if s.prefix_cache_routing not in CACHE_ROUTING_MODES:
        raise SettingsError(
            f"PREFIX_CACHE_ROUTING={s.prefix_cache_routing!r}: expected one of "
            f"{', '.join(CACHE_ROUTING_MODES)}"
        )
    if s.prefix_cache_routing in ("events", "approx") and not s.prefix_caching:
        # auto needs no error: with caching off the stack runs the proxy with routing off.
        raise SettingsError(
            f"PREFIX_CACHE_ROUTING={s.prefix_cache_routing} needs PREFIX_CACHING=true (with "
            "caching off no replica holds a prefix to route by): set it to auto or off"
        )
    if s.prefix_caching:
        try:
            ipaddress.IPv4Address(s.host)
        except ValueError:
            raise SettingsError(
                f"LOCAL_HOST={s.host!r}: must be an IPv4 address while PREFIX_CACHING is on (the "
                "KV-event publishers bind it; commands.kv_events_endpoint)"
            ) from None
    if s.otlp_traces_protocol not in OTLP_PROTOCOLS:
        raise SettingsError(
            f"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL={s.otlp_traces_protocol!r}: expected one of "
            f"{', '.join(OTLP_PROTOCOLS)}"
        )
    if s.nixl_progress_delay_us < 0:
        raise SettingsError("NIXL_PROGRESS_DELAY_US must be >= 0")
    if s.kv_lease_s < 6:
        # vLLM renews a lease with heartbeats every lease // 6 seconds: 0 would never renew.
        raise SettingsError(f"NIXL_KV_LEASE_S={s.kv_lease_s}: must be >= 6 (seconds)")
    for name in (
        "startup_timeout_s",
        "prometheus_scrape_interval_s",
        "proxy_connect_timeout_s",
        "proxy_prefill_timeout_s",
        "proxy_decode_timeout_s",
        "eval_request_timeout_s",
        "queue_timeout_s",
    ):
        if getattr(s, name) <= 0:
            env_key = next(k for k, v in ENV_KEYS.items() if v == name)
            raise SettingsError(f"{env_key} must be > 0")
    # Decode must never read KV blocks whose lease ran out, and the demo's eval must not give up
    # before the proxy answers (pd_proxy.timeouts; the proxy checks the lease itself too).
    problems = timeout_problems(
        s.kv_lease_s, proxy_limits(s), client_s=s.eval_request_timeout_s, names=KIT_NAMES
    )
    if problems:
        raise SettingsError(" ".join(problems))
    try:
        parse_extra_connectors(s.kv_extra_connectors, kit_connector=s.kv_connector)
    except ValueError as exc:
        raise SettingsError(str(exc)) from None
    if s.demo_limit < 1:
        raise SettingsError("DEMO_LIMIT must be >= 1")
