"""The JSON codec every part of the proxy uses: orjson when installed, the stdlib otherwise.

orjson parses and encodes the two legs' bodies several times faster than ``json``. It is stricter
(no NaN or Infinity, no lone surrogates), so whatever it refuses is retried with the stdlib and the
proxy accepts what it accepted before. One difference remains: orjson reads integers beyond 64
bits as floats, which no vLLM field can take anyway.
"""

from __future__ import annotations

import json
from typing import Any

try:
    import orjson
except ImportError:  # pragma: no cover - the kit pins orjson; this keeps a bare checkout working
    orjson = None  # type: ignore[assignment]


def _std_loads(data: bytes) -> Any:
    try:
        return json.loads(data)
    except RecursionError:
        raise TooDeep("nested too deeply") from None


def _std_dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


if orjson is not None:
    _orjson_loads = orjson.loads
    _orjson_dumps = orjson.dumps
    _OrjsonError = orjson.JSONDecodeError
    _OrjsonEncodeError = orjson.JSONEncodeError

    def loads(data: bytes) -> Any:
        """Parse JSON bytes; ``ValueError`` (or ``UnicodeDecodeError``) when they are not JSON,
        ``TooDeep`` when they nest deeper than the parsers go."""
        try:
            return _orjson_loads(data)
        except _OrjsonError:
            return _std_loads(data)

    def dumps(obj: Any) -> bytes:
        """Compact UTF-8 JSON bytes."""
        try:
            return _orjson_dumps(obj)
        except _OrjsonEncodeError:
            return _std_dumps(obj)

else:  # pragma: no cover
    loads = _std_loads
    dumps = _std_dumps


class TooDeep(ValueError):
    """JSON nested deeper than the parsers go (orjson stops at 1024 levels, the stdlib at
    Python's recursion limit)."""
