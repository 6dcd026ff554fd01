"""A client body decoded and checked as the proxy needs it before anything else reads it."""

from __future__ import annotations

from typing import Any

from pd_proxy.protocol.codec import TooDeep, loads
from pd_proxy.protocol.endpoints import REQUIRED_FIELD, Endpoint


class BadRequest(ValueError):
    """The client body cannot be proxied; the message is safe to return to the client."""


def parse_request(body: bytes, endpoint: Endpoint) -> dict[str, Any]:
    """Decode and minimally validate a client body; raise ``BadRequest`` with a client message."""
    try:
        obj = loads(body)
    except TooDeep:
        raise BadRequest("request body is nested too deeply to be parsed") from None
    except (ValueError, UnicodeDecodeError):
        raise BadRequest("request body is not valid JSON") from None
    if not isinstance(obj, dict):
        raise BadRequest("request body must be a JSON object")
    field = REQUIRED_FIELD[endpoint]
    if obj.get(field) is None:
        raise BadRequest(f"'{field}' is required")
    return obj
