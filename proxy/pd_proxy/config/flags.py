"""The command line and the ``PD_PROXY_*`` environment, read into one ``ProxyConfig``.

Every option is one row of ``OPTIONS``: its field, flag, variable, converter and help. A flag
given on the command line wins over its variable; argparse exits 2 on a bad flag by itself.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping, Sequence

from pd_proxy.config.settings import ENV_PREFIX, LOG_LEVELS, ROLES, ProxyConfig
from pd_proxy.config.values import ConfigError, parse_bool, parse_size, split_urls

# (dest, flag, env suffix, converter, help)
OPTIONS: tuple[tuple[str, str, str, Callable[[str], object], str], ...] = (
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
        parse_size,
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
        "cache_index_max_blocks",
        "--cache-index-max-blocks",
        "CACHE_INDEX_MAX_BLOCKS",
        int,
        "block-replica pairs the KV-event index keeps per role (a block held by 3 replicas "
        "counts 3; about 150 bytes each); past it the oldest stored go, counted in "
        "pd_proxy_cache_index_evicted_blocks_total (default 4000000)",
    ),
    (
        "cache_ready_timeout",
        "--cache-ready-timeout",
        "CACHE_READY_TIMEOUT",
        float,
        "with KV events, /health answers 503 until every replica's publishers were replayed or "
        "sent a first batch, for at most this many seconds; then the proxy serves anyway, with "
        "a log line and pd_proxy_cache_ready_timeouts_total (0: no wait; default 30)",
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
        "prefill_max_inflight",
        "--prefill-max-inflight",
        "PREFILL_MAX_INFLIGHT",
        int,
        "admission: requests whose prefill leg may run on one prefill replica at once; more wait "
        "in the proxy's queue (0: no limit; default 16)",
    ),
    (
        "prefill_max_tokens",
        "--prefill-max-tokens",
        "PREFILL_MAX_TOKENS",
        int,
        "admission: uncached prompt tokens in flight on one prefill replica; one request always "
        "fits an idle replica (0: no limit; default 65536)",
    ),
    (
        "decode_max_inflight",
        "--decode-max-inflight",
        "DECODE_MAX_INFLIGHT",
        int,
        "admission: requests admitted to one decode replica and not finished (0: no limit; "
        "default 256)",
    ),
    (
        "decode_max_pending_pulls",
        "--decode-max-pending-pulls",
        "DECODE_MAX_PENDING_PULLS",
        int,
        "admission: P/D requests whose KV one decode replica has not pulled yet (prefilling or "
        "held on the prefill); past it no prefill leg starts for that decode (0: no limit; "
        "default 32)",
    ),
    (
        "queue_size",
        "--queue-size",
        "QUEUE_SIZE",
        int,
        "admission: requests that may wait for room, shared fairly among the flows waiting; "
        "past it 429 with Retry-After (default 64)",
    ),
    (
        "queue_timeout",
        "--queue-timeout",
        "QUEUE_TIMEOUT",
        float,
        "admission: longest wait for room; a request whose predicted wait is longer is refused "
        "at once (429 with Retry-After) (default 60)",
    ),
    (
        "flow_header",
        "--flow-header",
        "FLOW_HEADER",
        str,
        "admission: a header naming the client's flow, set by an authenticating gateway in "
        "front (trusted as is: only for a proxy no client reaches directly; default: none, "
        "the client key names the flow)",
    ),
    (
        "max_flow_labels",
        "--max-flow-labels",
        "MAX_FLOW_LABELS",
        int,
        "admission: distinct flow label values of pd_proxy_queue_depth and "
        "pd_proxy_queue_wait_seconds; past it the rest share 'other', and a flow idle for 10 "
        "minutes gives its label up (default 100)",
    ),
    (
        "tokenize_timeout",
        "--tokenize-timeout",
        "TOKENIZE_TIMEOUT",
        float,
        "seconds a decode's /tokenize may take when the proxy needs a prompt's tokens (the "
        "--local-prefill-max-tokens decision, cache-aware routing); past it the request goes P/D "
        "uncounted (default 2)",
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
    for dest, flag, env, conv, text in OPTIONS:
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
    admission = parser.add_mutually_exclusive_group()
    admission.add_argument(
        "--admission",
        dest="admission",
        action="store_true",
        default=None,
        help="admit a request only when its route has room, else queue it fairly per flow or "
        "refuse it with 429/503 and Retry-After (default) [PD_PROXY_ADMISSION=true|false]",
    )
    admission.add_argument(
        "--no-admission",
        dest="admission",
        action="store_false",
        help="send every request to the backends at once (vLLM's own queue, first come first "
        "served)",
    )
    parser.add_argument(
        "--client-priority",
        dest="client_priority",
        action="store_true",
        default=None,
        help="admission: a request's own integer 'priority' field (vLLM's; lower is earlier) "
        "adds to its key's band (default: off, the field only reaches vLLM) "
        "[PD_PROXY_CLIENT_PRIORITY=true|false]",
    )
    return parser


# Variables of settings that were merged into another: named, so a deployment that sets one learns
# it has no effect instead of running silently without it.
GONE = {"SIDE_CALL_TIMEOUT": "TOKENIZE_TIMEOUT"}


def _from_env(environ: Mapping[str, str]) -> dict[str, object]:
    values: dict[str, object] = {}
    for old, new in GONE.items():
        if environ.get(f"{ENV_PREFIX}{old}", "").strip():
            raise ConfigError(
                f"{ENV_PREFIX}{old} is gone: the one limit on /tokenize is {ENV_PREFIX}{new}"
            )
    for role in ROLES:
        raw = environ.get(f"{ENV_PREFIX}{role.upper()}")
        if raw is not None and raw.strip():
            values[role] = split_urls(raw)
    converters = [(d, e, c) for d, _f, e, c, _t in OPTIONS] + [
        ("metrics", "METRICS", parse_bool),
        ("metrics_created", "METRICS_CREATED", parse_bool),
        ("first_token_from_prefill", "FIRST_TOKEN_FROM_PREFILL", parse_bool),
        ("admission", "ADMISSION", parse_bool),
        ("client_priority", "CLIENT_PRIORITY", parse_bool),
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
