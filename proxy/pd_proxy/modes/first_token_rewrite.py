"""First token from prefill (``--first-token-from-prefill``): the protocol as pure functions.

The prefill leg already samples token 1 (it runs with ``max_tokens=1``). In this mode the proxy
asks it for the token ids too (``return_token_ids``), sends token 1 to the client at once, and lets
decode continue from the prompt plus that token, with one token less to generate:

- ``/v1/completions``: decode gets ``prompt = prompt_token_ids + [token 1]`` (token ids, so no
  re-tokenisation can change the sequence) and ``max_tokens - 1``;
- ``/v1/chat/completions``: decode gets the client's chat request with
  ``kv_transfer_params.prompt_token_ids = prompt_token_ids + [token 1]``, vLLM's decode-side token
  reuse (vllm/renderers/online_renderer.py, ``_reused_prompt_token_ids``): decode skips the chat
  template and feeds those ids to the engine, and still answers as a chat completion.

Either way the decode pulls the prompt's KV from prefill and computes only token 1's KV itself:
vLLM's NIXL decode counts every prompt token as remote, reads the prefill's blocks into its own,
then, since its prompt is all "computed", recomputes the last position (token 1) to sample
token 2. The blocks must line up: the decode allocates blocks for ``N + 1`` tokens and asserts it
holds no more than the prefill sent (``_apply_prefix_caching``), so the proxy continues this way
only when the prefill's blocks have a slot for position ``N`` (``N + 1 <= blocks * block_size``,
the block size read from the prefill's ``vllm:cache_config_info``); otherwise, and whenever a
request's parameters would make the continuation differ from the normal flow, the request takes
the normal flow (``request_fallback``, ``continuation_problem``), which is always exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeGuard

from pd_proxy.protocol.codec import dumps, loads
from pd_proxy.protocol.endpoints import CHAT_COMPLETIONS, COMPLETIONS, Endpoint
from pd_proxy.protocol.pd_bodies import prefill_body, usage, usage_options
from pd_proxy.protocol.sse import DONE, EventSplitter, event, event_json, events

# vLLM's CompletionRequest.max_tokens default (chat has none: the context decides).
COMPLETIONS_DEFAULT_MAX_TOKENS = 16

# Request fields whose effect depends on the tokens generated before, on the random stream, or
# on more than one sequence: with them the continuation would not equal the normal flow, so the
# request takes the normal flow. ``None`` in the value: any value other than these is a reason.
_UNLESS_ABSENT_OR: dict[str, tuple[Any, ...]] = {
    "n": (None, 1),
    "best_of": (None, 1),
    "use_beam_search": (None, False),
    "echo": (None, False),
    "logprobs": (None, False),  # completions: an int; chat: a bool
    "top_logprobs": (None, 0),
    "prompt_logprobs": (None,),
    "logprob_token_ids": (None,),
    "return_token_ids": (None, False),
    "return_prompt_text": (None, False),
    "suffix": (None,),
    "prompt_embeds": (None,),
    "frequency_penalty": (None, 0),  # counts the tokens decode generated, not token 1
    "presence_penalty": (None, 0),
    "bad_words": (None,),  # multi-token bad words look at the output before
    "structured_outputs": (None,),  # a grammar would restart after token 1
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
    "guided_decoding_backend": (None,),
    "vllm_xargs": (None,),  # custom logits processors: unknown state
    "thinking_token_budget": (None, -1),
    "repetition_detection": (None,),
    "watermarking": (None, False),
    "tools": (None,),  # tool parsing would not see token 1
    "functions": (None,),
}
_EMPTY_OK = ("bad_words", "tools", "functions")  # an empty list is the same as none

# The chat message fields a reasoning or tool parser fills: token 1 was not plain content.
_PARSED_FIELDS = ("reasoning", "reasoning_content", "tool_calls", "function_call")


def _allowed(value: Any, allowed: tuple[Any, ...]) -> bool:
    """``value`` is one of ``allowed``: None and booleans by identity, numbers by value (so
    ``0`` is not ``False``, and ``0.0`` is ``0``)."""
    for a in allowed:
        if a is None or type(a) is bool:
            if value is a:
                return True
        elif type(value) in (int, float) and value == a:
            return True
    return False


def _positive_int(value: Any) -> bool:
    return type(value) is int and value >= 1


def _is_int_list(value: Any) -> TypeGuard[list[int]]:
    return isinstance(value, list) and bool(value) and all(type(x) is int for x in value)


def max_new_tokens(endpoint: Endpoint, body: dict[str, Any]) -> Any:
    """The client's generation limit as vLLM reads it (None: chat without one)."""
    if endpoint == COMPLETIONS:
        value = body.get("max_tokens")
        return COMPLETIONS_DEFAULT_MAX_TOKENS if value is None else value
    value = body.get("max_completion_tokens")
    return body.get("max_tokens") if value is None else value


def request_fallback(endpoint: Endpoint, body: dict[str, Any]) -> str | None:
    """The parameter that makes this request take the normal flow, or None."""
    for name in _UNLESS_ABSENT_OR.keys() & body.keys():  # the few a request sets
        value = body[name]
        if not (_allowed(value, _UNLESS_ABSENT_OR[name]) or (name in _EMPTY_OK and value == [])):
            return name
    if body.get("seed") is not None and body.get("temperature") != 0:
        return "seed"  # the seeded generator would restart on decode
    format_ = body.get("response_format")
    if format_ is not None and not (isinstance(format_, dict) and format_.get("type") == "text"):
        return "response_format"
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    # A stop string longer than a character could start in token 1 and end in token 2, which
    # neither server would see, and vLLM holds back its first characters while streaming.
    if stop is not None and not (
        isinstance(stop, list) and all(isinstance(s, str) and len(s) <= 1 for s in stop)
    ):
        return "stop"
    limit = max_new_tokens(endpoint, body)
    if limit is not None and not _positive_int(limit):
        if endpoint == CHAT_COMPLETIONS and body.get("max_completion_tokens") is not None:
            return "max_completion_tokens"
        return "max_tokens"
    min_tokens = body.get("min_tokens")
    if min_tokens is not None and not (
        type(min_tokens) is int and 0 <= min_tokens <= (min_tokens if limit is None else limit)
    ):
        return "min_tokens"  # invalid: the normal flow lets vLLM say so
    if endpoint == COMPLETIONS:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and not _is_int_list(prompt):
            prompt = prompt[0]  # a batch of one prompt is one choice
        if not ((isinstance(prompt, str) and prompt) or _is_int_list(prompt)):
            return "prompt"  # several prompts: several choices
    elif not _text_only(body.get("messages")):
        return "messages"  # media: decode re-renders the messages and ignores forwarded ids
    return None


def _text_only(messages: Any) -> bool:
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


def prefill_body_first_token(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill leg of this mode: the normal one, plus the token ids, and ``min_tokens``
    kept at 1 when the client asked for any (EOS must not end token 1 then)."""
    out = prefill_body(body)
    out["return_token_ids"] = True
    min_tokens = body.get("min_tokens")
    if type(min_tokens) is int and min_tokens >= 1:
        out["min_tokens"] = 1
    return out


@dataclass
class FirstToken:
    """Token 1 as the prefill leg answered it."""

    obj: dict[str, Any]  # the prefill's whole answer
    text: str  # token 1's text (completions: ``text``; chat: ``message.content``)
    token_id: int
    prompt_ids: list[int]
    finish_reason: str
    stop_reason: Any
    prompt_tokens: int  # usage.prompt_tokens: what the client's prompt counts
    role: str  # chat: the message's role

    @property
    def kv(self) -> Any:
        return self.obj.get("kv_transfer_params")


def parse_first_token(endpoint: Endpoint, obj: Any) -> FirstToken | str:
    """Token 1 from the prefill's answer, or why the answer cannot serve as token 1."""
    if not isinstance(obj, dict):
        return "prefill_answer"
    choices = obj.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        return "prefill_answer"
    choice = choices[0]
    role = "assistant"
    if endpoint == COMPLETIONS:
        text = choice.get("text")
        prompt_ids = choice.get("prompt_token_ids")
    else:
        message = choice.get("message")
        if not isinstance(message, dict):
            return "prefill_answer"
        if any(message.get(name) for name in _PARSED_FIELDS):
            return "parsed_output"  # a reasoning or tool parser took token 1
        text = message.get("content")
        role = message.get("role") or role
        prompt_ids = obj.get("prompt_token_ids")
    token_ids = choice.get("token_ids")
    usage = obj.get("usage")
    prompt_tokens = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    finish = choice.get("finish_reason")
    if (
        not isinstance(text, str)
        or not _is_int_list(prompt_ids)
        or not _is_int_list(token_ids)
        or len(token_ids) != 1
        or finish not in ("length", "stop")
        or not isinstance(role, str)
    ):
        return "prefill_answer"
    if type(prompt_tokens) is not int:
        prompt_tokens = len(prompt_ids)
    return FirstToken(
        obj, text, token_ids[0], prompt_ids, finish, choice.get("stop_reason"), prompt_tokens, role
    )


def finished_at_first(endpoint: Endpoint, body: dict[str, Any], first: FirstToken) -> bool:
    """Token 1 ends the request: EOS, a stop token or string, or a limit of one token."""
    return first.finish_reason == "stop" or max_new_tokens(endpoint, body) == 1


def block_groups(kv: dict[str, Any]) -> list[list[Any]] | None:
    """``remote_block_ids`` per KV cache group (vLLM sends a list per group), or None."""
    blocks = kv.get("remote_block_ids")
    if not isinstance(blocks, list) or not blocks:
        return None
    if all(type(b) is int for b in blocks):
        return [blocks]  # one group, written flat
    if all(isinstance(g, list) and g for g in blocks):
        return blocks
    return None


def needs_block_size(first: FirstToken) -> bool:
    """Whether decode will pull KV for this continuation (so the blocks must line up)."""
    kv = first.kv
    return isinstance(kv, dict) and bool(kv.get("do_remote_prefill"))


def continuation_problem(first: FirstToken, block_size: int | None) -> str | None:
    """Why decode cannot continue from prompt + token 1 exactly and safely, or None."""
    if not first.text:
        # Token 1 is a special token or an incomplete UTF-8 character: vLLM's detokenizer,
        # primed with a prompt that ends in it, would print the prompt text again.
        return "first_token_text"
    if not needs_block_size(first):
        return None  # no KV to pull: decode computes the prompt itself
    kv = first.kv
    n = len(first.prompt_ids)
    computed = kv.get("remote_num_tokens")
    if type(computed) is not int or computed < n:
        return "kv_tokens"  # the prefill stopped short of the prompt: token 1 is not the model's
    if kv.get("dcp_size") not in (None, 1) or kv.get("pp_size") not in (None, 1):
        return "kv_layout"
    groups = block_groups(kv)
    if groups is None:
        return "kv_blocks"
    if block_size is None:
        return "block_size"
    if any(len(group) * block_size < n + 1 for group in groups):
        return "kv_blocks"  # no slot for position N in the prefill's last block
    return None


def continuation_body(
    endpoint: Endpoint, body: dict[str, Any], first: FirstToken
) -> dict[str, Any]:
    """The decode leg of this mode: continue from prompt + token 1, one token fewer."""
    out = dict(body)
    ids = [*first.prompt_ids, first.token_id]
    kv = first.kv
    if endpoint == COMPLETIONS:
        out["prompt"] = ids
        out["max_tokens"] = max_new_tokens(endpoint, body) - 1
        out["kv_transfer_params"] = kv
    else:
        kv = kv if isinstance(kv, dict) else {}
        out["kv_transfer_params"] = {**kv, "prompt_token_ids": ids}
        limit = max_new_tokens(endpoint, body)
        if body.get("max_completion_tokens") is not None:
            out["max_completion_tokens"] = limit - 1
            out.pop("max_tokens", None)  # vLLM reads max_completion_tokens first
        elif limit is not None:
            out["max_tokens"] = limit - 1
    min_tokens = body.get("min_tokens")
    if min_tokens:
        out["min_tokens"] = min_tokens - 1
    # The ids are already truncated (and carry the BOS): applying these again would cut them.
    for name in ("truncate_prompt_tokens", "truncation_side", "add_special_tokens"):
        out.pop(name, None)
    return out


# ---------------------------------------------------------------------- answers to the client
class _Chunks:
    """vLLM's stream chunks for this request (ids, model and time from the prefill's answer)."""

    def __init__(self, endpoint: Endpoint, body: dict[str, Any], first: FirstToken) -> None:
        self.chat = endpoint == CHAT_COMPLETIONS
        self.first = first
        obj = first.obj
        self.head = {
            "id": obj.get("id"),
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": obj.get("created"),
            "model": obj.get("model"),
        }
        self.include_usage, self.continuous = usage_options(body)

    def _chunk(self, choice: dict[str, Any], completion_tokens: int, **extra: Any) -> bytes:
        chunk = {**self.head, "choices": [choice], **extra}
        if self.continuous:
            chunk["usage"] = usage(self.first.prompt_tokens, completion_tokens)
        return event(chunk)

    def start(self) -> bytes:
        """The chat role chunk (none for completions)."""
        if not self.chat:
            return b""
        choice = {
            "index": 0,
            "delta": {"role": self.first.role, "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        return self._chunk(choice, 0, prompt_token_ids=None, prompt_text=None)

    def token(self, finished: bool) -> bytes:
        """Token 1's chunk; with ``finished``, the last one (finish and stop reasons)."""
        first = self.first
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            choice["delta"] = {"content": first.text}
        else:
            choice["text"] = first.text
        choice["logprobs"] = None
        choice["finish_reason"] = first.finish_reason if finished else None
        if finished or not self.chat:
            choice["stop_reason"] = first.stop_reason if finished else None
        if not self.chat:
            choice["prompt_token_ids"] = None
        choice["token_ids"] = None
        return self._chunk(choice, 1)

    def usage(self) -> bytes:
        """The final usage chunk, when the client asked for one."""
        if not self.include_usage:
            return b""
        chunk: dict[str, Any] = {
            **self.head,
            "choices": [],
            "usage": usage(self.first.prompt_tokens, 1),
        }
        if self.first.obj.get("system_fingerprint") is not None:
            chunk["system_fingerprint"] = self.first.obj["system_fingerprint"]
        return event(chunk)


def stream_head(endpoint: Endpoint, body: dict[str, Any], first: FirstToken) -> bytes:
    """What the client gets at once: (chat: the role chunk, then) token 1's chunk."""
    chunks = _Chunks(endpoint, body, first)
    return chunks.start() + chunks.token(finished=False)


def finished_stream(endpoint: Endpoint, body: dict[str, Any], first: FirstToken) -> bytes:
    """The whole stream of a request that token 1 ended."""
    chunks = _Chunks(endpoint, body, first)
    return chunks.start() + chunks.token(finished=True) + chunks.usage() + DONE


def finished_json(endpoint: Endpoint, first: FirstToken) -> bytes:
    """The JSON answer of a request that token 1 ended: the prefill's own, less the KV handles
    and the token ids the client did not ask for."""
    obj = dict(first.obj)
    obj["kv_transfer_params"] = None
    choice = dict(obj["choices"][0])
    choice["token_ids"] = None
    if endpoint == COMPLETIONS:
        choice["prompt_token_ids"] = None
    else:
        obj["prompt_token_ids"] = None
    obj["choices"] = [choice]
    return dumps(obj)


def fix_usage(usage: Any, first: FirstToken) -> None:
    """Decode's usage counted token 1 as prompt: give it back to the completion."""
    if not isinstance(usage, dict):
        return
    completion = usage.get("completion_tokens")
    completion = (completion if type(completion) is int else 0) + 1
    usage["prompt_tokens"] = first.prompt_tokens
    usage["completion_tokens"] = completion
    usage["total_tokens"] = first.prompt_tokens + completion


def merge_json(endpoint: Endpoint, first: FirstToken, data: bytes) -> bytes:
    """Decode's JSON answer with token 1 put back in front; ``ValueError`` if it is not one."""
    obj = loads(data)
    choices = obj.get("choices") if isinstance(obj, dict) else None
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        raise ValueError("not a completion with one choice")
    choice = choices[0]
    if endpoint == COMPLETIONS:
        choice["text"] = first.text + (choice.get("text") or "")
    else:
        message = choice.get("message")
        if not isinstance(message, dict):
            raise ValueError("chat choice without a message")
        message["content"] = first.text + (message.get("content") or "")
    fix_usage(obj.get("usage"), first)
    return dumps(obj)


class ContinuationFilter:
    """Decode's event stream on its way to the client: whole events, with the chat role chunk
    dropped (the client already has one) and every ``usage`` given token 1 back.

    Events without ``"usage":`` pass as the backend's bytes; the key cannot occur unescaped
    inside a JSON string, so the byte test finds exactly the chunks that carry usage.
    """

    def __init__(self, endpoint: Endpoint, first: FirstToken) -> None:
        self.first = first
        self._splitter = EventSplitter()
        self._drop_role = endpoint == CHAT_COMPLETIONS

    def feed(self, data: bytes) -> bytes:
        """The complete events of ``data`` (after what came before), rewritten as needed."""
        done = self._splitter.feed(data)
        if not self._drop_role and b'"usage":' not in done:
            return done
        out = []
        for one in events(done):
            if self._drop_role:
                self._drop_role = False
                if _is_role_chunk(one):
                    continue
            out.append(self._fix_event(one) if b'"usage":' in one else one + b"\n\n")
        return b"".join(out)

    def flush(self) -> bytes:
        """Bytes after the last complete event (a well-formed stream leaves none)."""
        return self._splitter.flush()

    def _fix_event(self, data: bytes) -> bytes:
        obj = event_json(data)
        if obj is None or not isinstance(obj.get("usage"), dict):
            return data + b"\n\n"
        fix_usage(obj["usage"], self.first)
        return event(obj)


def _is_role_chunk(data: bytes) -> bool:
    """vLLM's first chat chunk: the role, empty content, nothing else."""
    obj = event_json(data)
    if obj is None:
        return False
    choices = obj.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        return False
    delta = choices[0].get("delta")
    return (
        isinstance(delta, dict)
        and "role" in delta
        and not delta.get("content")
        and set(delta) <= {"role", "content"}
    )
