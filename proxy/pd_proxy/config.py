"""Proxy settings: one frozen dataclass, filled from command-line flags over environment variables.

Every flag has a ``PD_PROXY_*`` variable so compose files can configure the proxy without a
command line; a flag given on the command line wins. Bad values raise ``ConfigError`` (the CLI turns
it into exit code 2) instead of surfacing as a traceback at the first request.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

ENV_PREFIX = "PD_PROXY_"
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


class ConfigError(ValueError):
    """A setting is missing or malformed; the message names the flag and its variable."""


@dataclass(frozen=True)
class ProxyConfig:
    """Everything the app needs; defaults suit a local P/D pair."""

    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    host: str = "0.0.0.0"
    port: int = 8000
    connect_timeout: float = 5.0
    prefill_timeout: float = 300.0
    decode_timeout: float = 300.0
    max_body_bytes: int = 16 * 1024 * 1024
    health_interval: float = 5.0
    health_timeout: float = 2.0
    drain_timeout: float = 30.0
    log_level: str = "info"
    metrics: bool = True

    def __post_init__(self) -> None:
        for role in ("prefill", "decode"):
            urls = tuple(normalize_url(u, role) for u in getattr(self, role))
            object.__setattr__(self, role, urls)
        if not self.prefill:
            raise ConfigError("at least one --prefill URL is required (or PD_PROXY_PREFILL)")
        if not self.decode:
            raise ConfigError("at least one --decode URL is required (or PD_PROXY_DECODE)")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port {self.port} is outside 0-65535")
        for name in (
            "connect_timeout",
            "prefill_timeout",
            "decode_timeout",
            "health_interval",
            "health_timeout",
            "drain_timeout",  # aiohttp reads 0 as "wait forever"
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.max_body_bytes <= 0:
            raise ConfigError(f"max_body_bytes must be > 0, got {self.max_body_bytes}")
        if self.log_level.lower() not in LOG_LEVELS:
            raise ConfigError(f"log level {self.log_level!r} is not one of {', '.join(LOG_LEVELS)}")
        object.__setattr__(self, "log_level", self.log_level.lower())

    @property
    def logging_level(self) -> int:
        return getattr(logging, self.log_level.upper())


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
_OPTIONS: tuple[tuple[str, str, str, object, str], ...] = (
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
        metavar="URL",
        help="prefill backend base URL(s), e.g. http://127.0.0.1:8100 [PD_PROXY_PREFILL, "
        "comma or space separated]",
    )
    parser.add_argument(
        "--decode",
        nargs="+",
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
    return parser


def _from_env(environ: Mapping[str, str]) -> dict[str, object]:
    values: dict[str, object] = {}
    for role in ("prefill", "decode"):
        raw = environ.get(f"{ENV_PREFIX}{role.upper()}")
        if raw is not None and raw.strip():
            values[role] = split_urls(raw)
    converters = [(d, e, c) for d, _f, e, c, _t in _OPTIONS] + [("metrics", "METRICS", _bool)]
    for dest, env, conv in converters:
        raw = environ.get(f"{ENV_PREFIX}{env}")
        if raw is None or raw.strip() == "":
            continue
        try:
            values[dest] = conv(raw.strip())  # type: ignore[operator]
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
    for role in ("prefill", "decode"):
        urls: list[str] = []
        for item in values.get(role) or []:
            urls.extend(split_urls(str(item)))
        values[role] = tuple(urls)
    return ProxyConfig(**values)  # type: ignore[arg-type]
