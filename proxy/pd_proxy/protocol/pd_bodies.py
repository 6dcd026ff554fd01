"""The P/D protocol as pure functions: decode the client body, build and encode the two legs.

vLLM's NIXL connector expects the prefill instance to see the client's request with
``do_remote_decode`` set and generation cut to one token (so it only fills the KV cache and hands
back ``kv_transfer_params``); the decode instance then gets the client's original request plus those
params and pulls the KV blocks instead of recomputing them.

JSON goes through orjson when installed, the stdlib otherwise. orjson parses and encodes the two
legs' bodies several times faster than ``json``. It is stricter (no NaN or Infinity, no lone
surrogates), so whatever it refuses is retried with the stdlib and the proxy accepts what it
accepted before. One difference remains: orjson reads integers beyond 64 bits as floats, which no
vLLM field can take anyway.
"""

from __future__ import annotations

import json
from typing import Any

try:
    import orjson
except ImportError:  # pragma: no cover - the kit pins orjson; this keeps a bare checkout working
    orjson = None  # type: ignore[assignment]

JSON_TYPE = "application/json"
COMPLETIONS = "/v1/completions"
CHAT_COMPLETIONS = "/v1/chat/completions"

# The field each endpoint cannot do without.
REQUIRED_FIELD = {COMPLETIONS: "prompt", CHAT_COMPLETIONS: "messages"}

# Fields that must not reach the one-token prefill: streaming options, lower length bounds (a
# min_tokens above 1 would contradict max_tokens=1) and structured output: the prefill's token is
# discarded (decode samples token 1 again, under the grammar), the KV does not depend on it, and a
# grammar on the kit's CPU prefill (Model Runner V2, Triton interpreter) kills its engine.
PREFILL_DROPPED = (
    "stream_options",
    "min_tokens",
    "min_completion_tokens",
    "response_format",
    "structured_outputs",
)


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


class BadRequest(ValueError):
    """The client body cannot be proxied; the message is safe to return to the client."""


class TooDeep(ValueError):
    """JSON nested deeper than the parsers go (orjson stops at 1024 levels, the stdlib at
    Python's recursion limit)."""


def prefill_kv_params() -> dict[str, Any]:
    """What a prefill instance needs to keep the KV blocks for a remote decode."""
    return {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }


def parse_request(body: bytes, endpoint: str) -> dict[str, Any]:
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


def prefill_body(request: dict[str, Any]) -> dict[str, Any]:
    """The prefill leg: the client body, non-streaming, one token, asking to keep KV for decode."""
    body = dict(request)
    body["kv_transfer_params"] = prefill_kv_params()
    body["stream"] = False
    body["max_tokens"] = 1
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    for key in PREFILL_DROPPED:
        body.pop(key, None)
    return body


def decode_body(request: dict[str, Any], kv_transfer_params: Any) -> dict[str, Any]:
    """The decode leg: the client's original body plus the prefill's ``kv_transfer_params``."""
    body = dict(request)
    body["kv_transfer_params"] = kv_transfer_params
    return body


def release_body(request: dict[str, Any], kv_transfer_params: Any) -> dict[str, Any]:
    """A decode request that only takes the prefill's KV (so the prefill frees its blocks now,
    not when their lease ends): the decode leg cut to one token, its answer discarded."""
    body = prefill_body(request)
    body["kv_transfer_params"] = kv_transfer_params
    return body


def kv_params_from_prefill(payload: bytes) -> Any:
    """Pull ``kv_transfer_params`` out of the prefill's JSON response.

    ``None`` is legitimate (vLLM returns it when the one prefill token was EOS); decode then
    computes the prompt itself. A body that is not a JSON object raises ``ValueError``.
    """
    obj = loads(payload)
    if not isinstance(obj, dict):
        raise ValueError("prefill response is not a JSON object")
    return obj.get("kv_transfer_params")


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """An answer's ``usage`` counts, in vLLM's key order."""
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
    }


def usage_options(body: dict[str, Any]) -> tuple[bool, bool]:
    """(include_usage, continuous_usage_stats) as vLLM reads a stream's ``stream_options``."""
    options = body.get("stream_options")
    if not isinstance(options, dict) or not options.get("include_usage"):
        return False, False
    return True, bool(options.get("continuous_usage_stats"))


def decode_payload(raw: bytes, request: dict[str, Any], kv_transfer_params: Any) -> bytes:
    """The decode leg as bytes: the client's own bytes with ``kv_transfer_params`` appended.

    Splicing skips re-encoding the whole body (the prompt can be large), and decode sees exactly
    what the client sent. A body the splice cannot handle safely (one that already carries
    ``kv_transfer_params``, or is not a plain UTF-8 ``{...}``) is re-encoded from ``request``.
    """
    body = raw.strip(b" \t\r\n")
    if "kv_transfer_params" in request or body[:1] != b"{" or body[-1:] != b"}":
        return dumps(decode_body(request, kv_transfer_params))
    return b"".join((body[:-1], b',"kv_transfer_params":', dumps(kv_transfer_params), b"}"))
