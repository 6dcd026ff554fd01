"""API keys read from files: the clients' keys the proxy accepts, and the key it sends to vLLM.

Keys live in files, never on the command line (where ``ps`` would show them). A key file holds one
key per line; blank lines and lines starting with ``#`` are ignored. Both kinds of file are re-read
when their stat signature (inode, size, mtime, ctime) changes, checked at most once per
``RELOAD_INTERVAL_S`` on the request path, so keys rotate without a restart. A file that goes
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

from pd_proxy.config.textfile import TextFileError, read_text

log = logging.getLogger("pd_proxy.api.auth")

RELOAD_INTERVAL_S = 1.0
MISSING_KEY = "missing API key: send the header 'Authorization: Bearer <key>'"
INVALID_KEY = "invalid API key"


class KeyFileError(ValueError):
    """A key file is missing, unreadable, empty, or holds a malformed key."""


def parse_keys(text: str) -> tuple[str, ...]:
    """The keys of a key file's text: one per line, blank lines and ``#`` comments skipped."""
    keys = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if any(ch.isspace() for ch in line):
            raise KeyFileError(f"line {number} holds whitespace inside the key")
        keys.append(line)
    return tuple(dict.fromkeys(keys))  # duplicates dropped, order kept


def read_key_file(path: str) -> tuple[str, ...]:
    """The keys of ``path``; ``KeyFileError`` (with the reason, never a key) when there are none."""
    try:
        text = read_text(path)
    except TextFileError as exc:
        raise KeyFileError(f"cannot read key file {path}: {exc}") from None
    try:
        keys = parse_keys(text)
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

    def _use(self, keys: tuple[str, ...]) -> None:
        """Precompute what the request path needs from ``keys``."""


def _digest(key: str) -> bytes:
    # surrogateescape: aiohttp decodes header bytes that are not UTF-8 that way.
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()


class ClientKeys(KeyFile):
    """Keys clients must present as ``Authorization: Bearer <key>``."""

    what = "client API key"

    def _use(self, keys: tuple[str, ...]) -> None:
        # Digest -> digest: the lookup finds a candidate, compare_digest confirms it.
        self._digests = {d: d for d in map(_digest, keys)}

    def check(self, authorization: str | None) -> str | None:
        """``None`` when the header carries a valid key, else the message for the 401."""
        self.refresh()
        if not authorization:
            return MISSING_KEY
        scheme, _, token = authorization.partition(" ")
        token = token.strip()
        if not token or scheme.lower() != "bearer":
            return MISSING_KEY
        digest = _digest(token)
        stored = self._digests.get(digest)
        if stored is None or not hmac.compare_digest(stored, digest):
            return INVALID_KEY
        return None


class BackendKey(KeyFile):
    """The one key (the file's first) the proxy sends to vLLM backends."""

    what = "backend API key"

    def _use(self, keys: tuple[str, ...]) -> None:
        self._header = f"Bearer {keys[0]}"

    def header(self) -> str:
        """The ``Authorization`` value for a backend request."""
        self.refresh()
        return self._header
