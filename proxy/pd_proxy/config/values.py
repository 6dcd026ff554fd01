"""The value checks and converters behind the settings: addresses, URLs, booleans, sizes. Pure."""

from __future__ import annotations

import ipaddress
import re
from urllib.parse import urlsplit

from pd_proxy.config.service_ref import parse_service_ref

_DNS_LABEL = re.compile(r"(?!-)[A-Za-z0-9_-]{1,63}(?<!-)")


class ConfigError(ValueError):
    """Settings are missing or malformed; each of ``problems`` names its flag and variable."""

    def __init__(self, *problems: str) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems


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
    Whether the pod sees the API server (and knows its namespace) is pd_proxy.api.startup_checks's
    check."""
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


def parse_bool(value: str) -> bool:
    low = value.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected true/false, got {value!r}")


def parse_size(value: str) -> int:
    """Bytes, with an optional k/m/g suffix (powers of 1024)."""
    match = re.fullmatch(r"\s*(\d+)\s*([kKmMgG]?)[iI]?[bB]?\s*", value)
    if not match:
        raise ValueError(f"expected a size like 16777216 or 16M, got {value!r}")
    scale = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3}[match.group(2).lower()]
    return int(match.group(1)) * scale
