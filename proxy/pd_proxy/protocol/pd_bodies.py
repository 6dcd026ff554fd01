"""The P/D protocol as pure functions: build and encode the two legs' bodies.

vLLM's NIXL connector expects the prefill instance to see the client's request with
``do_remote_decode`` set and generation cut to one token (so it only fills the KV cache and hands
back ``kv_transfer_params``); the decode instance then gets the client's original request plus those
params and pulls the KV blocks instead of recomputing them.
"""

from __future__ import annotations

from typing import Any

from pd_proxy.protocol.client_fields import is_token_ids
from pd_proxy.protocol.codec import dumps, loads
from pd_proxy.protocol.endpoints import CHAT_COMPLETIONS, COMPLETIONS, Endpoint

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


def reuses_prompt_ids(endpoint: Endpoint, request: dict[str, Any]) -> bool:
    """Whether the decode leg can take the prompt as the token ids the prefill computed, so the
    decode (the latency-bound server) neither tokenizes nor renders a chat template again, and
    computes on exactly the tokens whose KV it pulls. Completions: one text prompt (the decode
    gets ``prompt`` = the ids); chat: text-only messages (vLLM's decode-side token reuse,
    ``kv_transfer_params.prompt_token_ids``). Not where the prompt's text is answered (``echo``,
    ``return_prompt_text``) or a completions ``suffix`` is rendered around it."""
    if request.get("echo") or request.get("return_prompt_text"):
        return False
    if endpoint == COMPLETIONS:
        prompt = request.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        return (
            isinstance(prompt, str)
            and bool(prompt)
            and request.get("suffix") is None
            and request.get("prompt_embeds") is None
        )
    return endpoint == CHAT_COMPLETIONS and text_only(request.get("messages"))


def text_only(messages: Any) -> bool:
    """Chat messages of text alone: what vLLM's decode-side token reuse accepts (it renders
    media itself, ignoring forwarded ids)."""
    if not isinstance(messages, list):
        return False
    for message in messages:
        if not isinstance(message, dict):
            return False
        content = message.get("content")
        if isinstance(content, list):
            for part in content:
                if not isinstance(part, dict) or part.get("type", "text") != "text":
                    return False
                if set(part) - {"type", "text"}:
                    return False
    return True


def prefill_body(request: dict[str, Any], prompt_ids: bool = False) -> dict[str, Any]:
    """The prefill leg: the client body, non-streaming, one token, asking to keep KV for decode
    (``prompt_ids``: and to answer the prompt's token ids, ``reuses_prompt_ids``)."""
    body = dict(request)
    if prompt_ids:
        body["return_token_ids"] = True
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


def prefill_answer(payload: bytes) -> dict[str, Any]:
    """The prefill's JSON response; a body that is not a JSON object raises ``ValueError``."""
    obj = loads(payload)
    if not isinstance(obj, dict):
        raise ValueError("prefill response is not a JSON object")
    return obj


def kv_params_from_prefill(payload: bytes) -> Any:
    """Pull ``kv_transfer_params`` out of the prefill's JSON response.

    ``None`` is legitimate (vLLM returns it when the one prefill token was EOS); decode then
    computes the prompt itself. A body that is not a JSON object raises ``ValueError``.
    """
    return prefill_answer(payload).get("kv_transfer_params")


def prompt_ids_from_prefill(endpoint: Endpoint, answer: dict[str, Any]) -> list[int] | None:
    """The prompt's token ids in a prefill answer to ``return_token_ids`` (completions: in its
    one choice; chat: at the top), or None."""
    if endpoint == COMPLETIONS:
        choices = answer.get("choices")
        if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
            return None
        ids = choices[0].get("prompt_token_ids")
    else:
        ids = answer.get("prompt_token_ids")
    return ids if is_token_ids(ids) and ids else None


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


def decode_payload(
    raw: bytes,
    request: dict[str, Any],
    kv_transfer_params: Any,
    endpoint: Endpoint = COMPLETIONS,
    prompt_ids: list[int] | None = None,
) -> bytes:
    """The decode leg as bytes: the client's own bytes with ``kv_transfer_params`` appended.

    Splicing skips re-encoding the whole body (the prompt can be large), and decode sees exactly
    what the client sent. A body the splice cannot handle safely (one that already carries
    ``kv_transfer_params``, or is not a plain UTF-8 ``{...}``) is re-encoded from ``request``.
    With the prefill's ``prompt_ids`` (and KV to pull), a completions prompt is replaced by them
    (re-encoded), and a chat request carries them in ``kv_transfer_params``.
    """
    if prompt_ids is not None and isinstance(kv_transfer_params, dict):
        if endpoint == COMPLETIONS:
            body_obj = decode_body(request, kv_transfer_params)
            body_obj["prompt"] = prompt_ids
            return dumps(body_obj)
        kv_transfer_params = {**kv_transfer_params, "prompt_token_ids": prompt_ids}
    body = raw.strip(b" \t\r\n")
    if "kv_transfer_params" in request or body[:1] != b"{" or body[-1:] != b"}":
        return dumps(decode_body(request, kv_transfer_params))
    return b"".join((body[:-1], b',"kv_transfer_params":', dumps(kv_transfer_params), b"}"))
