"""Keys read from files (one key per line, optional ``flow=``, ``weight=``, ``priority=`` fields
after a client key), reloaded when the file changes; and the ``BackendKey`` the proxy sends to
vLLM. The file format and reload rules: pd_proxy.api.auth, which checks the clients' keys.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from pd_proxy.config.textfile import TextFileError, read_text

# The logger keeps its name from before the split: operators' log filters match it.
log = logging.getLogger("pd_proxy.api.auth")

RELOAD_INTERVAL_S = 1.0


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


class BackendKey(KeyFile):
    """The one key (the file's first) the proxy sends to vLLM backends."""

    what = "backend API key"

    def _use(self, keys: tuple[KeyEntry, ...]) -> None:
        self._header = f"Bearer {keys[0].key}"

    def header(self) -> str:
        """The ``Authorization`` value for a backend request."""
        self.refresh()
        return self._header
