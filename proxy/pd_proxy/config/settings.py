"""Proxy settings: one frozen dataclass, filled from command-line flags over environment variables.

Every flag has a ``PD_PROXY_*`` variable so compose files can configure the proxy without a
command line; a flag given on the command line wins. Bad values raise ``ConfigError`` (the CLI turns
it into exit code 2) instead of surfacing as a traceback at the first request. Nothing here reads a
file or the network: pd_proxy.api.startup_checks checks the key files, the endpoints file and the
cluster.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

from pd_proxy.config.values import (
    ConfigError,
    check_host_port,
    check_k8s_service,
    normalize_url,
)
from pd_proxy.timeouts import PROXY_NAMES, ProxyLimits, timeout_problems

ENV_PREFIX = "PD_PROXY_"
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
# --prefix-cache-routing: off; KV events only; the proxy's own record only; events where a replica
# publishes them, the record elsewhere.
CACHE_OFF, CACHE_EVENTS, CACHE_APPROX, CACHE_AUTO = "off", "events", "approx", "auto"
CACHE_ROUTING_MODES = (CACHE_OFF, CACHE_EVENTS, CACHE_APPROX, CACHE_AUTO)
CACHE_WITH_EVENTS = (CACHE_EVENTS, CACHE_AUTO)
CACHE_WITH_APPROX = (CACHE_APPROX, CACHE_AUTO)
ROLES = ("prefill", "decode")
MAX_WORKERS = 256
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # an HTTP field name (RFC 9110)
ENDPOINTS_FLAG = f"--endpoints-file ({ENV_PREFIX}ENDPOINTS_FILE)"
# (field, flag) of the key files pd_proxy.api.startup_checks reads.
KEY_FILES = (("api_key_file", "--api-key-file"), ("backend_api_key_file", "--backend-api-key-file"))


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
    # The circuit breaker (pd_proxy.backends.breaker): failed checks in a row that take a backend
    # out, and
    # passed checks in a row that end its probation (one request at a time) once it is back.
    health_failures: int = 1
    health_successes: int = 2
    drain_timeout: float = 30.0
    log_level: str = "info"
    metrics: bool = True
    # Paths, never keys: the files are read (and re-read when they change) by pd_proxy.api.auth.
    api_key_file: str | None = None
    backend_api_key_file: str | None = None
    metrics_port: int | None = None  # None: /metrics on the main port
    # Discovery (pd_proxy.discovery.watch): "host:port" names and a file, re-read every interval.
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
    # Token 1 from the prefill leg, the rest from decode (pd_proxy.modes.first_token_rewrite).
    first_token_from_prefill: bool = False
    # The prefill's KV lease (vLLM's kv_lease_duration): when set, limits that could let decode
    # read expired KV blocks are refused (pd_proxy.timeouts).
    kv_lease_s: float | None = None
    # The canary (pd_proxy.api.canary): minutes between runs (None or 0: off) and one run's limit.
    canary_minutes: float | None = None
    canary_timeout: float = 60.0
    # Conditional disaggregation: prompts of at most this many tokens go to decode alone (0: none).
    local_prefill_max_tokens: int = 0
    # Cache-aware routing (pd_proxy.routing.cache): off, events, approx or auto; its scorer's
    # settings.
    prefix_cache_routing: str = "off"
    cache_overlap_weight: float = 4.0
    cache_max_imbalance: int = 4
    cache_approx_blocks: int = 20000
    # The KV-event index's bound per role, in block-replica pairs (about 150 bytes each), and
    # how long /health waits at start for every publisher's replay or first batch.
    cache_index_max_blocks: int = 4_000_000
    cache_ready_timeout: float = 30.0
    # The served model's tokenizer files (a folder), for token ids without a /tokenize round trip.
    tokenizer: str | None = None
    # The one limit on learning a prompt's tokens from a decode's /tokenize (pd_proxy.routing.
    # token_count): past it the request goes P/D uncounted.
    tokenize_timeout: float = 2.0
    # Admission (pd_proxy.admission): limits per replica (0: none), the queue's bounds, who a
    # flow is behind a gateway, and whether a request's own priority field moves its band. The
    # defaults suit GPU replicas; the CPU stacks set smaller ones (.env.example).
    admission: bool = True
    prefill_max_inflight: int = 16
    prefill_max_tokens: int = 65536
    decode_max_inflight: int = 256
    decode_max_pending_pulls: int = 32
    queue_size: int = 64
    queue_timeout: float = 60.0
    flow_header: str | None = None
    client_priority: bool = False
    # Distinct {flow} label values of admission's series; past it the rest share "other".
    max_flow_labels: int = 100

    def __post_init__(self) -> None:
        """Normalise the values and check what needs no I/O; every problem is listed at once.

        Files and the cluster are checked by pd_proxy.api.startup_checks, once, before serving.
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
                # With an endpoints file, pd_proxy.api.startup_checks reads it to know the roles it
                # covers.
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
        return problems + self._cache_problems() + self._admission_problems()

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
        if self.cache_index_max_blocks <= 0:
            problems.append(
                f"cache_index_max_blocks must be > 0, got {self.cache_index_max_blocks}"
            )
        if self.cache_ready_timeout < 0:
            problems.append(
                f"cache_ready_timeout must be >= 0 (0: no wait), got {self.cache_ready_timeout}"
            )
        if self.tokenize_timeout <= 0:
            problems.append(f"tokenize_timeout must be > 0, got {self.tokenize_timeout}")
        if self.tokenizer is not None and not self.tokenizer.strip():
            problems.append(f"--tokenizer ({ENV_PREFIX}TOKENIZER) is an empty path")
        return problems

    def _admission_problems(self) -> list[str]:
        problems: list[str] = []
        for name in (
            "prefill_max_inflight",
            "prefill_max_tokens",
            "decode_max_inflight",
            "decode_max_pending_pulls",
        ):
            if getattr(self, name) < 0:
                problems.append(f"{name} must be >= 0 (0: no limit), got {getattr(self, name)}")
        if self.queue_size < 0:
            problems.append(f"queue_size must be >= 0 (0: refuse when full), got {self.queue_size}")
        if self.queue_timeout <= 0:
            problems.append(f"queue_timeout must be > 0, got {self.queue_timeout}")
        if self.max_flow_labels < 0:
            problems.append(f"max_flow_labels must be >= 0, got {self.max_flow_labels}")
        if self.flow_header is not None and not _TOKEN.fullmatch(self.flow_header):
            problems.append(
                f"--flow-header ({ENV_PREFIX}FLOW_HEADER) {self.flow_header!r} is not a header name"
            )
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
