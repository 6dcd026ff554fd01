"""The P/D protocol as pure functions: build and encode the two legs' bodies.

vLLM's NIXL connector expects the prefill instance to see the client's request with
``do_remote_decode`` set and generation cut to one token (so it only fills the KV cache and hands
back ``kv_transfer_params``); the decode instance then gets the client's original request plus those
params and pulls the KV blocks instead of recomputing them.
"""

from __future__ import annotations

from typing import Any

from pd_proxy.protocol.codec import dumps, loads

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
