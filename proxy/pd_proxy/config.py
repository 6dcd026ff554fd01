"""Proxy settings: one frozen dataclass, filled from command-line flags over environment variables.

Every flag has a ``PD_PROXY_*`` variable so compose files can configure the proxy without a
command line; a flag given on the command line wins. Bad values raise ``ConfigError`` (the CLI turns
it into exit code 2) instead of surfacing as a traceback at the first request. Nothing here reads a
file or the network: pd_proxy.validate checks the key files, the endpoints file and the cluster.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

from pd_proxy.k8s_endpoints import parse_service_ref
from pd_proxy.timeouts import PROXY_NAMES, ProxyLimits, timeout_problems

ENV_PREFIX = "PD_PROXY_"
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
CACHE_ROUTING_MODES = ("off", "events", "approx", "auto")  # pd_proxy.cache.router
ROLES = ("prefill", "decode")
MAX_WORKERS = 256
ENDPOINTS_FLAG = f"--endpoints-file ({ENV_PREFIX}ENDPOINTS_FILE)"
# (field, flag) of the key files pd_proxy.validate reads.
KEY_FILES = (("api_key_file", "--api-key-file"), ("backend_api_key_file", "--backend-api-key-file"))
_DNS_LABEL = re.compile(r"(?!-)[A-Za-z0-9_-]{1,63}(?<!-)")


class ConfigError(ValueError):
    """Settings are missing or malformed; each of ``problems`` names its flag and variable."""

    def __init__(self, *problems: str) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems


def no_backend(role: str) -> str:
    return (
        f"no {role} backend: give --{role} URL ({ENV_PREFIX}{role.upper()}), "
        f"--{role}-dns HOST:PORT ({ENV_PREFIX}{role.upper()}_DNS), "
        f"--{role}-k8s-service NAME ({ENV_PREFIX}{role.upper()}_K8S_SERVICE) or "
        f"an --endpoints-file listing one ({ENV_PREFIX}ENDPOINTS_FILE)"
    )


@dataclass(frozen=True)
class ProxyConfig:
    """Everything the app needs; defaults suit a local P/D pair.

    Each role needs at least one backend source: fixed URLs, a DNS name (``*_dns``, re-resolved
    every ``discovery_interval``) or entries in ``endpoints_file``; sources may be combined.
    """

    prefill: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()
    host: str = "0.0.0.0"
    port: int = 8000
    connect_timeout: float = 5.0
    prefill_timeout: float = 300.0
    decode_timeout: float = 300.0
    max_body_bytes: int = 16 * 1024 * 1024
    health_interval: float = 5.0
    health_timeout: float = 2.0
    # The circuit breaker (pd_proxy.health): failed checks in a row that take a backend out, and
    # passed checks in a row that end its probation (one request at a time) once it is back.
    health_failures: int = 1
    health_successes: int = 2
    # A side call on a request's path (the prompt's /tokenize count for
    # --local-prefill-max-tokens): longer falls back to P/D.
    side_call_timeout: float = 2.0
    drain_timeout: float = 30.0
    log_level: str = "info"
    metrics: bool = True
    # Paths, never keys: the files are read (and re-read when they change) by pd_proxy.auth.
    api_key_file: str | None = None
    backend_api_key_file: str | None = None
    metrics_port: int | None = None  # None: /metrics on the main port
    # Discovery (pd_proxy.discovery): "host:port" names and a file, re-read every interval.
    prefill_dns: str | None = None
    decode_dns: str | None = None
    endpoints_file: str | None = None
    # Kubernetes Services "[NAMESPACE/]NAME[:PORT]" whose EndpointSlices are watched (in a pod).
    prefill_k8s_service: str | None = None
    decode_k8s_service: str | None = None
    discovery_interval: float = 5.0
    # Serving processes on the one port (SO_REUSEPORT); 1 runs the proxy in this process.
    workers: int = 1
    # Export a ``_created`` series beside each counter and histogram (prometheus_client's default).
    metrics_created: bool = False
    # Token 1 from the prefill leg, the rest from decode (pd_proxy.rewrite_first_token).
    first_token_from_prefill: bool = False
    # The prefill's KV lease (vLLM's kv_lease_duration): when set, limits that could let decode
    # read expired KV blocks are refused (pd_proxy.timeouts).
    kv_lease_s: float | None = None
    # The canary (pd_proxy.canary): minutes between runs (None or 0: off) and one run's limit.
    canary_minutes: float | None = None
    canary_timeout: float = 60.0
    # Conditional disaggregation: prompts of at most this many tokens go to decode alone (0: none).
    local_prefill_max_tokens: int = 0
    # Cache-aware routing (pd_proxy.cache): off, events, approx or auto; its scorer's settings.
    prefix_cache_routing: str = "off"
    cache_overlap_weight: float = 4.0
    cache_max_imbalance: int = 4
    cache_approx_blocks: int = 20000
    # The served model's tokenizer files (a folder), for token ids without a /tokenize round trip.
    tokenizer: str | None = None
    tokenize_timeout: float = 1.0

    def __post_init__(self) -> None:
        """Normalise the values and check what needs no I/O; every problem is listed at once.

        Files and the cluster are checked by pd_proxy.validate, once, before serving.
        """
        problems: list[str] = []

        for role in ROLES:
            try:
                self._normalize_role(role)
            except ConfigError as exc:
                problems.extend(exc.problems)
        for role in ROLES:
            sources = (getattr(self, f"{role}_dns"), getattr(self, f"{role}_k8s_service"))
            if not getattr(self, role) and sources == (None, None) and not self.endpoints_file:
                # With an endpoints file, pd_proxy.validate reads it to know the roles it covers.
                problems.append(no_backend(role))
        if self.endpoints_file is not None and not self.endpoints_file.strip():
            problems.append(f"{ENDPOINTS_FLAG} is an empty path")
        if not 0 <= self.port <= 65535:
            problems.append(f"port {self.port} is outside 0-65535")
        for name in (
            "connect_timeout",
            "prefill_timeout",
            "decode_timeout",
            "health_interval",
            "health_timeout",
            "side_call_timeout",
            "drain_timeout",  # aiohttp reads 0 as "wait forever"
            "discovery_interval",
        ):
            if getattr(self, name) <= 0:
                problems.append(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("health_failures", "health_successes"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be >= 1, got {getattr(self, name)}")
        problems += self._lease_and_canary_problems()
        if not 1 <= self.workers <= MAX_WORKERS:
            problems.append(f"workers must be 1-{MAX_WORKERS}, got {self.workers}")
        if self.max_body_bytes <= 0:
            problems.append(f"max_body_bytes must be > 0, got {self.max_body_bytes}")
        if self.log_level.lower() not in LOG_LEVELS:
            problems.append(f"log level {self.log_level!r} is not one of {', '.join(LOG_LEVELS)}")
        else:
            object.__setattr__(self, "log_level", self.log_level.lower())
        for name, flag in KEY_FILES:
            path = getattr(self, name)
            if path is not None and not path.strip():
                problems.append(f"{flag} ({ENV_PREFIX}{name.upper()}) is an empty path")
        if self.metrics_port is not None:
            if not 0 <= self.metrics_port <= 65535:
                problems.append(f"metrics port {self.metrics_port} is outside 0-65535")
            if self.metrics_port == self.port != 0:
                problems.append(f"metrics port {self.metrics_port} is the main port")
            if not self.metrics:
                problems.append("--metrics-port (PD_PROXY_METRICS_PORT) is set but metrics are off")
        if problems:
            raise ConfigError(*problems)

    def _normalize_role(self, role: str) -> None:
        urls = tuple(normalize_url(u, role) for u in getattr(self, role))
        object.__setattr__(self, role, urls)
        name = f"{role}_dns"
        value = getattr(self, name)
        if value is not None:
            flag = f"--{role}-dns ({ENV_PREFIX}{name.upper()})"
            object.__setattr__(self, name, check_host_port(value, flag))
        name = f"{role}_k8s_service"
        value = getattr(self, name)
        if value is not None:
            flag = f"--{role}-k8s-service ({ENV_PREFIX}{name.upper()})"
            object.__setattr__(self, name, check_k8s_service(value, flag))

    def _lease_and_canary_problems(self) -> list[str]:
        problems: list[str] = []
        if self.kv_lease_s is not None:
            if self.kv_lease_s <= 0:
                problems.append(f"kv_lease_s must be > 0, got {self.kv_lease_s}")
            elif min(self.connect_timeout, self.prefill_timeout, self.decode_timeout) > 0:
                found = timeout_problems(self.kv_lease_s, self.limits(), names=PROXY_NAMES)
                problems += found[:1]
        if self.canary_minutes is not None and self.canary_minutes < 0:
            problems.append(f"canary_minutes must be >= 0 (0: off), got {self.canary_minutes}")
        if self.canary_timeout <= 0:
            problems.append(f"canary_timeout must be > 0, got {self.canary_timeout}")
        if (local := self.local_prefill_max_tokens) < 0:
            problems.append(f"local_prefill_max_tokens must be >= 0 (0: off), got {local}")
        return problems + self._cache_problems()

    def _cache_problems(self) -> list[str]:
        problems: list[str] = []
        mode = self.prefix_cache_routing.lower()
        if mode not in CACHE_ROUTING_MODES:
            problems.append(
                f"prefix_cache_routing {self.prefix_cache_routing!r} is not one of "
                f"{', '.join(CACHE_ROUTING_MODES)}"
            )
        else:
            object.__setattr__(self, "prefix_cache_routing", mode)
        if self.cache_overlap_weight < 0:
            problems.append(f"cache_overlap_weight must be >= 0, got {self.cache_overlap_weight}")
        if self.cache_max_imbalance < 0:
            problems.append(f"cache_max_imbalance must be >= 0, got {self.cache_max_imbalance}")
        if self.cache_approx_blocks <= 0:
            problems.append(f"cache_approx_blocks must be > 0, got {self.cache_approx_blocks}")
        if self.tokenize_timeout <= 0:
            problems.append(f"tokenize_timeout must be > 0, got {self.tokenize_timeout}")
        if self.tokenizer is not None and not self.tokenizer.strip():
            problems.append(f"--tokenizer ({ENV_PREFIX}TOKENIZER) is an empty path")
        return problems

    def limits(self) -> ProxyLimits:
        """The limits the KV-lease rule reads (pd_proxy.timeouts)."""
        wait = self.health_timeout if self.first_token_from_prefill else 0.0
        return ProxyLimits(self.connect_timeout, self.prefill_timeout, self.decode_timeout, wait)

    @property
    def logging_level(self) -> int:
        return getattr(logging, self.log_level.upper())

    @property
    def discovery(self) -> bool:
        """Whether any backend source can change at run time."""
        return bool(
            self.prefill_dns
            or self.decode_dns
            or self.endpoints_file
            or self.prefill_k8s_service
            or self.decode_k8s_service
        )

    def sources(self, role: str) -> list[str]:
        """The role's backend sources, for the start-up log line."""
        found = list(getattr(self, role))
        dns = getattr(self, f"{role}_dns")
        if dns is not None:
            found.append(f"dns:{dns}")
        service = getattr(self, f"{role}_k8s_service")
        if service is not None:
            found.append(f"k8s:{service}")
        if self.endpoints_file is not None:
            found.append(f"file:{self.endpoints_file}")
        return found


def split_host_port(value: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` into its parts; ``ValueError`` says what is wrong."""
    text = value.strip()
    if "://" in text or "/" in text:
        raise ValueError("expected HOST:PORT, not a URL")
    if text.startswith("["):
        host, sep, port = text[1:].partition("]:")
        if not sep:
            raise ValueError("expected [IPv6]:PORT")
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(f"{host!r} is not an IPv6 address") from None
    else:
        host, sep, port = text.rpartition(":")
        if not sep:
            raise ValueError("missing port, expected HOST:PORT")
        if not host:
            raise ValueError("missing host, expected HOST:PORT")
        name = host[:-1] if host.endswith(".") else host  # a fully qualified name may end in "."
        if len(name) > 253 or not all(_DNS_LABEL.fullmatch(p) for p in name.split(".")):
            raise ValueError(f"{host!r} is not a valid host name (IPv6 needs [brackets])")
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"port {port!r} is not a number in 1-65535")
    return host, int(port)


def check_host_port(value: str, flag: str) -> str:
    """``value`` as a canonical ``host:port``, or a ``ConfigError`` naming ``flag``."""
    try:
        host, port = split_host_port(value)
    except ValueError as exc:
        raise ConfigError(f"{flag} {value!r}: {exc}") from None
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def check_k8s_service(value: str, flag: str) -> str:
    """``value`` as a canonical ``[NAMESPACE/]NAME[:PORT]``, or a ``ConfigError`` naming ``flag``.
    Whether the pod sees the API server (and knows its namespace) is pd_proxy.validate's check."""
    try:
        return str(parse_service_ref(value))
    except ValueError as exc:
        raise ConfigError(f"{flag} {value!r}: {exc}") from None


def normalize_url(url: str, role: str) -> str:
    """Accept ``http(s)://host:port[/prefix]`` and drop a trailing slash so paths join cleanly."""
    url = url.strip()
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"{role} URL {url!r} must look like http://host:port")
    try:
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError as exc:
        raise ConfigError(f"{role} URL {url!r} has a bad port") from exc
    if parts.query or parts.fragment:
        raise ConfigError(f"{role} URL {url!r} must not carry a query or fragment")
    return url.rstrip("/")


def split_urls(value: str) -> list[str]:
    """Env lists may use commas, spaces or both."""
    return [u for u in re.split(r"[,\s]+", value) if u]


def _bool(value: str) -> bool:
    low = value.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected true/false, got {value!r}")


def _positive_size(value: str) -> int:
    """Bytes, with an optional k/m/g suffix (powers of 1024)."""
    match = re.fullmatch(r"\s*(\d+)\s*([kKmMgG]?)[iI]?[bB]?\s*", value)
    if not match:
        raise ValueError(f"expected a size like 16777216 or 16M, got {value!r}")
    scale = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3}[match.group(2).lower()]
    return int(match.group(1)) * scale


# (dest, flag, env suffix, converter, help)
_OPTIONS: tuple[tuple[str, str, str, Callable[[str], object], str], ...] = (
    ("host", "--host", "HOST", str, "address to listen on (default 0.0.0.0)"),
    ("port", "--port", "PORT", int, "port to listen on (default 8000)"),
    (
        "connect_timeout",
        "--connect-timeout",
        "CONNECT_TIMEOUT",
        float,
        "seconds to open a backend connection (default 5)",
    ),
    (
        "prefill_timeout",
        "--prefill-timeout",
        "PREFILL_TIMEOUT",
        float,
        "seconds for the whole prefill leg; exceeded gives 504 (default 300)",
    ),
    (
        "decode_timeout",
        "--decode-timeout",
        "DECODE_TIMEOUT",
        float,
        "longest silence from the decode backend: before its headers it gives 504, between stream "
        "chunks it ends the stream with an error event (default 300)",
    ),
    (
        "max_body_bytes",
        "--max-body-bytes",
        "MAX_BODY_BYTES",
        _positive_size,
        "largest accepted request body, bytes or with k/M/G suffix; larger gives 413 (default 16M)",
    ),
    (
        "health_interval",
        "--health-interval",
        "HEALTH_INTERVAL",
        float,
        "seconds between GET {backend}/health checks (default 5)",
    ),
    (
        "health_timeout",
        "--health-timeout",
        "HEALTH_TIMEOUT",
        float,
        "seconds one health check may take (default 2)",
    ),
    (
        "health_failures",
        "--health-failures",
        "HEALTH_FAILURES",
        int,
        "failed health checks in a row that take a backend out (default 1); a refused "
        "connection, or a check timing out while the backend's requests stopped and others "
        "progressed, counts as one",
    ),
    (
        "health_successes",
        "--health-successes",
        "HEALTH_SUCCESSES",
        int,
        "passed health checks in a row before a backend that was down takes its full share "
        "again; until then it takes one request at a time (default 2)",
    ),
    (
        "side_call_timeout",
        "--side-call-timeout",
        "SIDE_CALL_TIMEOUT",
        float,
        "seconds a call on the request path besides the two legs may take (the /tokenize count "
        "of --local-prefill-max-tokens); longer falls back to P/D (default 2)",
    ),
    (
        "drain_timeout",
        "--drain-timeout",
        "DRAIN_TIMEOUT",
        float,
        "on SIGTERM/SIGINT, seconds to let in-flight requests finish (default 30)",
    ),
    (
        "log_level",
        "--log-level",
        "LOG_LEVEL",
        str,
        f"one of {', '.join(LOG_LEVELS)}; info logs one line per request (default info)",
    ),
    (
        "api_key_file",
        "--api-key-file",
        "API_KEY_FILE",
        str,
        "file of client API keys, one per line (blank lines and # comments ignored); when set, "
        "every route but /health needs 'Authorization: Bearer <key>'. Re-read when it changes "
        "(default: none, anyone can use the proxy)",
    ),
    (
        "backend_api_key_file",
        "--backend-api-key-file",
        "BACKEND_API_KEY_FILE",
        str,
        "file whose first key the proxy sends to the backends as 'Authorization: Bearer' (vLLM's "
        "--api-key); the client's Authorization is never forwarded (default: none)",
    ),
    (
        "metrics_port",
        "--metrics-port",
        "METRICS_PORT",
        int,
        "serve GET /metrics only on this second port (same host, no key); the main port then "
        "answers /metrics with 404 (default: /metrics on the main port)",
    ),
    (
        "prefill_dns",
        "--prefill-dns",
        "PREFILL_DNS",
        str,
        "HOST:PORT whose A/AAAA records are the prefill backends (e.g. a Kubernetes headless "
        "Service), re-resolved every --discovery-interval; with or instead of --prefill",
    ),
    (
        "decode_dns",
        "--decode-dns",
        "DECODE_DNS",
        str,
        "HOST:PORT whose A/AAAA records are the decode backends; with or instead of --decode",
    ),
    (
        "prefill_k8s_service",
        "--prefill-k8s-service",
        "PREFILL_K8S_SERVICE",
        str,
        "[NAMESPACE/]SERVICE[:PORT] of a Kubernetes Service whose EndpointSlices are the prefill "
        "backends, watched through the API server (in a pod; needs list/watch on endpointslices): "
        "terminating pods stop getting requests at once. PORT: the Service port's name or the "
        "pod port (default: the only one); with or instead of --prefill",
    ),
    (
        "decode_k8s_service",
        "--decode-k8s-service",
        "DECODE_K8S_SERVICE",
        str,
        "[NAMESPACE/]SERVICE[:PORT] whose EndpointSlices are the decode backends; with or instead "
        "of --decode",
    ),
    (
        "endpoints_file",
        "--endpoints-file",
        "ENDPOINTS_FILE",
        str,
        "YAML or JSON file listing backends with their role (endpoints: [{role: prefill, url: "
        "http://10.0.0.5:8100}, ...]), re-read when it changes (default: none)",
    ),
    (
        "discovery_interval",
        "--discovery-interval",
        "DISCOVERY_INTERVAL",
        float,
        "seconds between DNS re-resolutions and endpoints-file checks (default 5)",
    ),
    (
        "workers",
        "--workers",
        "WORKERS",
        int,
        "proxy processes serving the one port (SO_REUSEPORT), each with its own backend pools and "
        "health checks, under a supervising parent; for hosts with many cores (default 1: one "
        "process)",
    ),
    (
        "kv_lease_s",
        "--kv-lease-s",
        "KV_LEASE_S",
        float,
        "the prefill's KV lease in seconds (vLLM's kv_connector_extra_config.kv_lease_duration, "
        "default 30): when given, the proxy refuses to start unless it exceeds --decode-timeout "
        "+ 2 x --connect-timeout (+ --health-timeout with --first-token-from-prefill), so decode "
        "never reads KV blocks the prefill already freed (default: not checked)",
    ),
    (
        "canary_minutes",
        "--canary-minutes",
        "CANARY_MINUTES",
        float,
        "every N minutes send a fixed greedy prompt through P/D and to a prefill alone and count "
        "a mismatch in pd_proxy_canary_mismatches_total (default: off)",
    ),
    (
        "canary_timeout",
        "--canary-timeout",
        "CANARY_TIMEOUT",
        float,
        "seconds one canary run may take; longer counts as an error (default 60)",
    ),
    (
        "local_prefill_max_tokens",
        "--local-prefill-max-tokens",
        "LOCAL_PREFILL_MAX_TOKENS",
        int,
        "send a prompt of at most N tokens (the model's tokenizer and chat template, counted by "
        "decode's /tokenize) to decode alone, which prefills it itself; longer ones go P/D "
        "(default 0: every request P/D); with --prefix-cache-routing it counts only the tokens "
        "the chosen decode does not hold in its prefix cache",
    ),
    (
        "prefix_cache_routing",
        "--prefix-cache-routing",
        "PREFIX_CACHE_ROUTING",
        str,
        "route by what each replica's prefix cache holds: events (vLLM's KV events, found at "
        "each backend's GET /kv_event_sources), approx (the proxy's own routing history), auto "
        "(events where a backend publishes them, approx elsewhere) or off (default off: least "
        "outstanding requests)",
    ),
    (
        "cache_overlap_weight",
        "--cache-overlap-weight",
        "CACHE_OVERLAP_WEIGHT",
        float,
        "cost of computing the whole prompt, in requests in flight: a replica holding the prompt "
        "wins over an idle one until it has this many more requests (default 4)",
    ),
    (
        "cache_max_imbalance",
        "--cache-max-imbalance",
        "CACHE_MAX_IMBALANCE",
        int,
        "a replica with more than this many requests above the least busy one gets none for "
        "its cache, so one hot prefix cannot pile up on it (default 4)",
    ),
    (
        "cache_approx_blocks",
        "--cache-approx-blocks",
        "CACHE_APPROX_BLOCKS",
        int,
        "blocks the approximate index remembers per replica, least recently used out; about the "
        "replica's KV cache size in blocks (default 20000)",
    ),
    (
        "tokenizer",
        "--tokenizer",
        "TOKENIZER",
        str,
        "folder with the served model's tokenizer.json (and tokenizer_config.json for the chat "
        "template): the proxy counts prompt tokens itself, after checking it agrees with a "
        "decode's /tokenize at start; what it cannot reproduce goes to /tokenize (default: none)",
    ),
    (
        "tokenize_timeout",
        "--tokenize-timeout",
        "TOKENIZE_TIMEOUT",
        float,
        "seconds a decode's /tokenize may take before the request goes P/D uncounted (default 1)",
    ),
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pd-proxy",
        description=(
            "Prefill/decode proxy for vLLM's NIXL kv_transfer_params protocol. Each option can "
            "also be set by the environment variable named in brackets; the flag wins."
        ),
    )
    parser.add_argument(
        "--prefill",
        nargs="+",
        action="extend",
        metavar="URL",
        help="prefill backend base URL(s), e.g. http://127.0.0.1:8100; optional with "
        "--prefill-dns or --endpoints-file [PD_PROXY_PREFILL, comma or space separated]",
    )
    parser.add_argument(
        "--decode",
        nargs="+",
        action="extend",
        metavar="URL",
        help="decode backend base URL(s) [PD_PROXY_DECODE, comma or space separated]",
    )
    for dest, flag, env, conv, text in _OPTIONS:
        parser.add_argument(flag, dest=dest, type=conv, help=f"{text} [{ENV_PREFIX}{env}]")
    metrics = parser.add_mutually_exclusive_group()
    metrics.add_argument(
        "--metrics",
        dest="metrics",
        action="store_true",
        default=None,
        help="serve Prometheus metrics at GET /metrics (default) [PD_PROXY_METRICS=true|false]",
    )
    metrics.add_argument(
        "--no-metrics",
        dest="metrics",
        action="store_false",
        help="do not serve GET /metrics",
    )
    parser.add_argument(
        "--metrics-created",
        dest="metrics_created",
        action="store_true",
        default=None,
        help="also export a _created series beside each counter and histogram (default: off) "
        "[PD_PROXY_METRICS_CREATED=true|false]",
    )
    parser.add_argument(
        "--first-token-from-prefill",
        dest="first_token_from_prefill",
        action="store_true",
        default=None,
        help="send the client token 1 as soon as the prefill leg has it, then let decode continue "
        "from the prompt plus that token (default: off) "
        "[PD_PROXY_FIRST_TOKEN_FROM_PREFILL=true|false]",
    )
    return parser


def _from_env(environ: Mapping[str, str]) -> dict[str, object]:
    values: dict[str, object] = {}
    for role in ROLES:
        raw = environ.get(f"{ENV_PREFIX}{role.upper()}")
        if raw is not None and raw.strip():
            values[role] = split_urls(raw)
    converters = [(d, e, c) for d, _f, e, c, _t in _OPTIONS] + [
        ("metrics", "METRICS", _bool),
        ("metrics_created", "METRICS_CREATED", _bool),
        ("first_token_from_prefill", "FIRST_TOKEN_FROM_PREFILL", _bool),
    ]
    for dest, env, conv in converters:
        raw = environ.get(f"{ENV_PREFIX}{env}")
        if raw is None or raw.strip() == "":
            continue
        try:
            values[dest] = conv(raw.strip())
        except ValueError as exc:
            raise ConfigError(f"{ENV_PREFIX}{env}={raw!r} is invalid: {exc}") from None
    return values


def load_config(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> ProxyConfig:
    """Flags over environment over defaults. argparse exits 2 on bad flags by itself."""
    environ = os.environ if environ is None else environ
    values = _from_env(environ)
    args = build_parser().parse_args(argv)
    for key, value in vars(args).items():
        if value is not None:
            values[key] = value
    for role in ROLES:
        urls: list[str] = []
        given = values.get(role) or []
        assert isinstance(given, (list, tuple))  # from split_urls or argparse's nargs
        for item in given:
            urls.extend(split_urls(str(item)))
        values[role] = tuple(urls)
    return ProxyConfig(**values)  # type: ignore[arg-type]
