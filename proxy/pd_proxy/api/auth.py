"""API keys read from files: the clients' keys the proxy accepts, and the key it sends to vLLM.

Keys live in files, never on the command line (where ``ps`` would show them). A key file holds one
key per line; blank lines and lines starting with ``#`` are ignored. After a client key, optional
fields name its admission flow and share: ``sk-team-a flow=team-a weight=2 priority=0`` (a key
without ``flow=`` is its own flow, named by a short digest of the key, never the key).

Both kinds of file are re-read when their stat signature (inode, size, mtime, ctime) changes,
checked at most once per ``RELOAD_INTERVAL_S`` on the request path, so keys rotate without a
restart. A file that goes
missing, unreadable or empty keeps the last good keys and logs one error per change.

Client keys are checked by SHA-256 digest: a dict lookup finds the candidate, then
``hmac.compare_digest`` confirms it, so neither step's timing depends on how much of a secret key
the client guessed right.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from aiohttp import web

from pd_proxy.config.textfile import TextFileError, read_text
from pd_proxy.errors import unauthorized_response

if TYPE_CHECKING:
    from pd_proxy.metrics import ProxyMetrics

log = logging.getLogger("pd_proxy.api.auth")
request_log = logging.getLogger("pd_proxy.request")

RELOAD_INTERVAL_S = 1.0
MISSING_KEY = "missing API key: send the header 'Authorization: Bearer <key>'"
INVALID_KEY = "invalid API key"


class KeyFileError(ValueError):
    """A key file is missing, unreadable, empty, or holds a malformed key."""


@dataclass(frozen=True)
class KeyEntry:
    """One line of a key file: the key, and for a client key its flow, weight and band."""

    key: str
    flow: str | None = None
    weight: float = 1.0
    priority: int = 0


def _entry(number: int, line: str) -> KeyEntry:
    key, *fields = line.split()
    values: dict[str, str] = {}
    for item in fields:
        name, sep, value = item.partition("=")
        if not sep or name not in ("flow", "weight", "priority") or not value:
            raise KeyFileError(
                f"line {number}: after the key, only flow=NAME, weight=W and priority=N may "
                f"follow (got {item.split('=')[0]!r})"
            )
        values[name] = value
    try:
        weight = float(values.get("weight", "1"))
        priority = int(values.get("priority", "0"))
    except ValueError:
        raise KeyFileError(f"line {number}: weight must be a number, priority an integer") from None
    if not 0 < weight < 1e6:
        raise KeyFileError(f"line {number}: weight must be > 0")
    return KeyEntry(key, values.get("flow"), weight, priority)


def parse_entries(text: str) -> tuple[KeyEntry, ...]:
    """The entries of a key file's text: one per line, blank lines and ``#`` comments skipped."""
    entries: dict[str, KeyEntry] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        entry = _entry(number, line)
        entries.setdefault(entry.key, entry)  # duplicates dropped, order kept
    return tuple(entries.values())


def parse_keys(text: str) -> tuple[str, ...]:
    """The keys of a key file's text."""
    return tuple(e.key for e in parse_entries(text))


def read_key_file(path: str) -> tuple[KeyEntry, ...]:
    """The entries of ``path``; ``KeyFileError`` (with the reason, never a key) when there are
    none."""
    try:
        text = read_text(path)
    except TextFileError as exc:
        raise KeyFileError(f"cannot read key file {path}: {exc}") from None
    try:
        keys = parse_entries(text)
    except KeyFileError as exc:
        raise KeyFileError(f"key file {path}: {exc}") from None
    if not keys:
        raise KeyFileError(f"key file {path} holds no key (only blank lines or # comments)")
    return keys


def _signature(path: str) -> tuple[int, ...] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


class KeyFile:
    """The keys of one file, reloaded when it changes. ``refresh()`` is the cheap hot-path check.

    The constructor raises ``KeyFileError`` when the file has no usable key: at start that is a
    configuration error; later failures only log and keep the last good keys.
    """

    what = "API key"

    def __init__(
        self,
        path: str,
        interval: float = RELOAD_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = path
        self.interval = interval
        self._clock = clock
        self._signature = _signature(path)  # before reading: a change in between reloads again
        self.keys = read_key_file(path)
        self._use(self.keys)
        self._checked_at = clock()

    def refresh(self) -> None:
        """Reload when due (at most once per ``interval``) and the file's signature changed."""
        now = self._clock()
        if now - self._checked_at < self.interval:
            return
        self._checked_at = now
        signature = _signature(self.path)
        if signature == self._signature:
            return
        self._signature = signature  # a bad new version is reported once, not every interval
        if signature is None:
            log.error(
                "%s file %s is gone or unreadable; keeping the last good key(s)",
                self.what,
                self.path,
            )
            return
        try:
            keys = read_key_file(self.path)
        except KeyFileError as exc:
            log.error("%s; keeping the last good key(s)", exc)
            return
        self.keys = keys
        self._use(keys)
        log.info("reloaded %s file %s: %d key(s)", self.what, self.path, len(keys))

    def _use(self, keys: tuple[KeyEntry, ...]) -> None:
        """Precompute what the request path needs from ``keys``."""


def _digest(key: str) -> bytes:
    # surrogateescape: aiohttp decodes header bytes that are not UTF-8 that way.
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()


@dataclass(frozen=True)
class Client:
    """Who a client key belongs to, for admission: its flow's name, weight and band."""

    flow: str
    weight: float = 1.0
    priority: int = 0


ANONYMOUS = Client("default")  # every request of a proxy without client keys


class ClientKeys(KeyFile):
    """Keys clients must present as ``Authorization: Bearer <key>``."""

    what = "client API key"

    def _use(self, keys: tuple[KeyEntry, ...]) -> None:
        # Digest -> (digest, client): the lookup finds a candidate, compare_digest confirms it.
        self._digests: dict[bytes, tuple[bytes, Client]] = {}
        for entry in keys:
            digest = _digest(entry.key)
            flow = entry.flow or f"key-{digest.hex()[:8]}"
            self._digests[digest] = (digest, Client(flow, entry.weight, entry.priority))

    def check(self, authorization: str | None) -> str | None:
        """``None`` when the header carries a valid key, else the message for the 401."""
        found = self.identify(authorization)
        return found if isinstance(found, str) else None

    def identify(self, authorization: str | None) -> Client | str:
        """The client a valid key names, else the message for the 401."""
        self.refresh()
        if not authorization:
            return MISSING_KEY
        scheme, _, token = authorization.partition(" ")
        token = token.strip()
        if not token or scheme.lower() != "bearer":
            return MISSING_KEY
        digest = _digest(token)
        stored = self._digests.get(digest)
        if stored is None or not hmac.compare_digest(stored[0], digest):
            return INVALID_KEY
        return stored[1]


class BackendKey(KeyFile):
    """The one key (the file's first) the proxy sends to vLLM backends."""

    what = "backend API key"

    def _use(self, keys: tuple[KeyEntry, ...]) -> None:
        self._header = f"Bearer {keys[0].key}"

    def header(self) -> str:
        """The ``Authorization`` value for a backend request."""
        self.refresh()
        return self._header


def unauthorized(
    request: web.Request, problem: str, metrics: ProxyMetrics, endpoint: str | None
) -> web.Response:
    """A bad or missing client key: a 401, counted (for an endpoint the metrics name) and logged
    in the request log, and no backend touched."""
    if endpoint is not None:
        metrics.count_request(endpoint, 401)
    if request_log.isEnabledFor(logging.INFO):
        request_log.info(
            "rid=- %s %s status=401 from=%s: %s",
            request.method,
            request.path,
            request.remote,
            problem,
        )
    return unauthorized_response(problem)
