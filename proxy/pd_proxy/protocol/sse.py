"""Server-sent events as vLLM's OpenAI server writes them: ``data: <json>`` events, each ended by
a blank line, the stream by ``data: [DONE]``. The one encoder of an event and the one splitter of
a byte stream into whole events; pure, no I/O (pd_proxy.http.relay moves the bytes).
"""

from __future__ import annotations

from typing import Any

from pd_proxy.protocol.codec import dumps, loads

MEDIA_TYPE = "text/event-stream"
SSE_TYPE = f"{MEDIA_TYPE}; charset=utf-8"  # vLLM's Content-Type for a stream
SEPARATOR = b"\n\n"
DATA = b"data: "
DONE = b"data: [DONE]\n\n"


def event(obj: Any) -> bytes:
    """One ``data:`` event carrying ``obj`` as JSON."""
    return DATA + dumps(obj) + SEPARATOR


def event_json(data: bytes) -> dict[str, Any] | None:
    """The JSON object of a ``data:`` event (without its separator); None for anything else
    (comments, other fields, ``[DONE]``, what does not parse)."""
    if not data.startswith(DATA):
        return None
    try:
        obj = loads(data[len(DATA) :])
    except (ValueError, UnicodeDecodeError):
        return None
    return obj if isinstance(obj, dict) else None


class EventSplitter:
    """Cuts a byte stream, as it arrives in arbitrary chunks, at event boundaries."""

    def __init__(self) -> None:
        self._rest = b""

    def feed(self, data: bytes) -> bytes:
        """The complete events of ``data`` after what came before, separators included (b"":
        none yet); the incomplete tail waits for the next chunk."""
        buf = self._rest + data if self._rest else data
        end = buf.rfind(SEPARATOR)
        if end < 0:
            self._rest = buf
            return b""
        self._rest = buf[end + 2 :]
        return buf[: end + 2]

    def flush(self) -> bytes:
        """Bytes after the last complete event (a well-formed stream leaves none)."""
        rest, self._rest = self._rest, b""
        return rest


def events(done: bytes) -> list[bytes]:
    """The events of ``EventSplitter.feed``'s bytes, without their separators."""
    return done.split(SEPARATOR)[:-1]
