"""A client body's fields the proxy itself acts on, read as vLLM reads them.

vLLM validates a request with pydantic in its lax mode: ``"stream": "yes"`` is a stream,
``"n": "2"`` two samples, ``"stream": "maybe"`` a 400. The proxy decides its way by some of those
fields before vLLM sees them (stream or JSON, how many P/D requests), so it reads them by the same
rules and writes the values back as JSON types: every mode, and both legs built from the object,
then agree with what decode will do with the client's bytes. A value vLLM would refuse is refused
here with a 400 naming the parameter, before any backend is touched. The readers are pure.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pd_proxy.protocol.errors import ProxyError

# pydantic's lax booleans (case-insensitive strings), as vLLM 0.32 accepts them.
_TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})
_FALSE = frozenset({"0", "off", "f", "false", "n", "no"})
_BOOLS = ("stream",)
_INTS = ("n",)
_OPTION_BOOLS = ("include_usage", "continuous_usage_stats")


def lax_bool(value: Any, name: str) -> bool:
    """``value`` as pydantic's lax mode reads a boolean; a 400 naming ``name`` otherwise."""
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        text = value.lower()
        if text in _TRUE:
            return True
        if text in _FALSE:
            return False
    raise ProxyError(400, f"'{name}' must be a boolean, got {_shown(value)}", name)


def lax_int(value: Any, name: str) -> int:
    """``value`` as pydantic's lax mode reads an integer; a 400 naming ``name`` otherwise."""
    if isinstance(value, int):  # bool included: pydantic reads true as 1
        return int(value)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            pass
    raise ProxyError(400, f"'{name}' must be an integer, got {_shown(value)}", name)


def read_fields(body: dict[str, Any]) -> None:
    """Check and normalise, in place, the fields the proxy acts on (None stays: vLLM's
    default)."""
    for name in _BOOLS:
        value = body.get(name)
        if value is not None and not isinstance(value, bool):
            body[name] = lax_bool(value, name)
    for name in _INTS:
        value = body.get(name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            body[name] = lax_int(value, name)
    options = body.get("stream_options")
    if options is None:
        return
    if not isinstance(options, dict):
        raise ProxyError(
            400, f"'stream_options' must be an object, got {_shown(options)}", "stream_options"
        )
    for name in _OPTION_BOOLS:
        value = options.get(name)
        if value is not None and not isinstance(value, bool):
            body["stream_options"] = options = {**options, name: lax_bool(value, name)}


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


# Bytes of request body per prompt token, for a request whose tokens were not counted (no local
# prefill limit, no cache-aware routing): English text runs about four characters a token, and
# the JSON around the prompt is small next to a long one.
BYTES_PER_TOKEN = 4


def estimated_tokens(body: bytes) -> int:
    return max(1, len(body) // BYTES_PER_TOKEN)


def request_priority(body: Mapping[str, Any]) -> int:
    """The request's ``priority`` (vLLM's field: an integer, lower is earlier), 0 if absent or
    not an integer (vLLM refuses such a request itself)."""
    value = body.get("priority")
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    return 0
