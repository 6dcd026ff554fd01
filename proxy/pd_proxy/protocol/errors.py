"""OpenAI-style error bodies, so SDK clients surface a readable message instead of a parse error."""

from __future__ import annotations

import json

from aiohttp import web

from pd_proxy.protocol.endpoints import JSON_TYPE

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",  # what OpenAI answers for a bad key, with code invalid_api_key
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_exceeded",
    499: "client_closed_request",
    502: "bad_gateway",
    503: "service_unavailable",
    504: "gateway_timeout",
}


class ProxyError(Exception):
    """Ends a request with an OpenAI-style error ``status`` and a message for the client
    (``param``: the request parameter it is about, as OpenAI's errors name it)."""

    code: str | None = None  # OpenAI's error code, when more precise than the status
    retry_after: int | None = None  # seconds, sent as Retry-After (429, 503)

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


class Passthrough(Exception):
    """A backend's own 4xx answer, returned to the client unchanged."""

    def __init__(self, status: int, body: bytes, content_type: str) -> None:
        super().__init__(status)
        self.status = status
        self.body = body
        self.content_type = content_type

    @property
    def message(self) -> str:
        """The backend's own message: its OpenAI ``error.message`` (vLLM's), a bare ``error``
        string, or the start of its body."""
        try:
            obj = json.loads(self.body)
        except (ValueError, UnicodeDecodeError, RecursionError):
            obj = None
        error = obj.get("error") if isinstance(obj, dict) else None
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return error["message"]
        if isinstance(error, str):
            return error
        return self.body[:200].decode("utf-8", "replace")


def error_body(
    status: int, message: str, code: int | str | None = None, param: str | None = None
) -> dict:
    return {
        "error": {
            "message": message,
            "type": ERROR_TYPES.get(status, "server_error"),
            "param": param,
            "code": status if code is None else code,
        }
    }


def error_response(
    status: int,
    message: str,
    request_id: str | None = None,
    *,
    param: str | None = None,
    code: str | None = None,
    retry_after: int | None = None,
) -> web.Response:
    headers = {"X-Request-Id": request_id} if request_id else {}
    if retry_after is not None:
        headers["Retry-After"] = str(retry_after)
    return web.Response(
        status=status,
        body=json.dumps(error_body(status, message, code, param)).encode(),
        content_type=JSON_TYPE,
        headers=headers,
    )


def unauthorized_response(message: str) -> web.Response:
    """401 for a missing or wrong client key, shaped like OpenAI's (``code: invalid_api_key``)."""
    return web.Response(
        status=401,
        body=json.dumps(error_body(401, message, "invalid_api_key")).encode(),
        content_type=JSON_TYPE,
        headers={"WWW-Authenticate": 'Bearer realm="pd-proxy"'},
    )


def sse_error_event(status: int, message: str, need_separator: bool) -> bytes:
    """Terminates a broken stream the way vLLM does: an error event, then ``[DONE]``.

    ``need_separator`` closes a half-relayed event first so the error parses as its own event.
    """
    prefix = b"\n\n" if need_separator else b""
    return (
        prefix
        + b"data: "
        + json.dumps(error_body(status, message)).encode()
        + (b"\n\ndata: [DONE]\n\n")
    )
