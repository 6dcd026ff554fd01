"""Read a small settings file (keys, endpoints) whole, with a reason fit for one log line."""

from __future__ import annotations


class TextFileError(ValueError):
    """The file could not be read; the message is the reason alone (callers add the context)."""


def read_text(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise TextFileError(reason) from None
