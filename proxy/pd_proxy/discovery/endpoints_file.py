"""Endpoints file: backends with role labels, for multi-host setups without Kubernetes.

YAML (or JSON, for a ``.json`` name), a mapping with one ``endpoints`` list. Each entry names its
``role`` and either a ``url`` or an ``address`` and ``port`` (plain http); ``name`` is free text
for people and is ignored::

    endpoints:
      - name: prefill-a
        role: prefill
        url: http://10.0.0.5:8100
      - role: decode
        address: 10.0.0.6
        port: 8200

Unknown keys are errors, so a typo (``rol:``) cannot silently drop a backend. The file is checked
at start (an error there is a configuration error) and re-read by pd_proxy.discovery.watch whenever
its
stat signature changes.
"""

from __future__ import annotations

import json
import os
from urllib.parse import urlsplit

from pd_proxy.config.textfile import TextFileError, read_text

ROLES = ("prefill", "decode")
_KEYS = frozenset(("name", "role", "url", "address", "port"))


class EndpointsFileError(ValueError):
    """The endpoints file is missing, unreadable or malformed; the message says where."""


def stat_signature(path: str) -> tuple[int, int, int, int]:
    """What changes when the file is rewritten or replaced (inode, size, mtime, ctime)."""
    st = os.stat(path)
    return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def read_endpoints_file(path: str) -> dict[str, tuple[str, ...]]:
    """The URLs per role listed in ``path`` (each role present, maybe empty).

    Error messages leave the path out: the caller's context names it.
    """
    try:
        text = read_text(path)
    except TextFileError as exc:
        raise EndpointsFileError(f"cannot read it: {exc}") from None
    return parse_endpoints(text, json_format=path.endswith(".json"))


def parse_endpoints(text: str, json_format: bool = False) -> dict[str, tuple[str, ...]]:
    """Parse and check an endpoints document; duplicates are dropped, order is kept."""
    if json_format:
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise EndpointsFileError(f"not valid JSON: {exc}") from None
    else:
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise EndpointsFileError(f"not valid YAML: {_one_line(exc)}") from None
    if not isinstance(data, dict) or not isinstance(data.get("endpoints"), list):
        # An empty file lands here too: usually a write caught half-way.
        raise EndpointsFileError("must be a mapping with an 'endpoints' list")
    extra = set(data) - {"endpoints"}
    if extra:
        raise EndpointsFileError(f"unknown top-level keys: {', '.join(sorted(map(str, extra)))}")
    found: dict[str, dict[str, None]] = {role: {} for role in ROLES}
    for i, entry in enumerate(data["endpoints"]):
        role, url = _entry(entry, f"endpoints[{i}]")
        found[role][url] = None
    return {role: tuple(urls) for role, urls in found.items()}


def _one_line(exc: Exception) -> str:
    """A parse error for a log line: YAML's own message spans several lines."""
    problem = getattr(exc, "problem", None)
    mark = getattr(exc, "problem_mark", None)
    if problem and mark is not None:
        return f"{problem} (line {mark.line + 1}, column {mark.column + 1})"
    return " ".join(str(exc).split())


def _entry(entry: object, where: str) -> tuple[str, str]:
    if not isinstance(entry, dict):
        raise EndpointsFileError(f"{where} must be a mapping with role and url (or address/port)")
    unknown = set(entry) - _KEYS
    if unknown:
        raise EndpointsFileError(
            f"{where} has unknown keys {', '.join(sorted(map(str, unknown)))} "
            f"(allowed: {', '.join(sorted(_KEYS))})"
        )
    role = entry.get("role")
    if role not in ROLES:
        raise EndpointsFileError(f"{where}: role must be prefill or decode, got {role!r}")
    if "url" in entry:
        if "address" in entry or "port" in entry:
            raise EndpointsFileError(f"{where}: give either url or address and port, not both")
        return role, _url(entry["url"], where)
    address, port = entry.get("address"), entry.get("port")
    if not isinstance(address, str) or not address.strip():
        raise EndpointsFileError(f"{where} needs a url, or an address and a port")
    if isinstance(port, bool) or not isinstance(port, (int, str)) or not str(port).isdigit():
        raise EndpointsFileError(f"{where}: port must be a number, got {port!r}")
    address = address.strip()
    host = f"[{address}]" if ":" in address and not address.startswith("[") else address
    return role, _url(f"http://{host}:{int(port)}", where)


def _url(value: object, where: str) -> str:
    """``http(s)://host:port[/prefix]`` without a trailing slash, as the config's URLs are."""
    if not isinstance(value, str):
        raise EndpointsFileError(f"{where}: url must be a string, got {value!r}")
    url = value.strip()
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = -1
    if (
        parts.scheme not in ("http", "https")
        or not parts.hostname
        or port == -1
        or port == 0
        or parts.query
        or parts.fragment
    ):
        raise EndpointsFileError(f"{where}: url {url!r} must look like http://host:port")
    return url.rstrip("/")
