"""The fake vLLM's "model" and wire protocol, as pure functions of a request body.

Kept apart from the server (``fake_vllm``) so that tests can compute what the fake answers, and
what it would tokenize, without running it, and so that the server holds only HTTP and state.
Its "model" is deterministic in the token context, so a continuation is exact the way vLLM's is:
prompts are tokenized (``tokenize``; chat messages through a small template), generated token
``k`` has id ``GEN_BASE + k`` and text `` t{k}``, and a prompt that ends in generated tokens
(prompt + token 1, as a first-token-from-prefill decode gets it) continues from the next ``k``.
``generate``'s ``eos_at`` makes token ``k`` EOS. It honours ``stop`` (strings),
``stop_token_ids``, ``min_tokens``, ``ignore_eos``, ``max_tokens`` / ``max_completion_tokens``
(chat without either: ``max_model_len`` minus the prompt, when set) and vLLM 0.32's decode-side
token reuse (``kv_transfer_params.prompt_token_ids`` on chat). The protocol: what makes a request
a broken P/D leg (``prefill_problem``, ``decode_problem``, ``block_mismatch``), the signature on
a prefill's handles, vLLM's ``--api-key`` check, the completion JSON and ``/metrics``. With GSM8K
answers (``load_answers``) a few-shot prompt's last question gets ``#### <number>``.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import time
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_SECRET = b"pd-proxy-fake-vllm"
PREFILL, DECODE, PLAIN = "prefill", "decode", "plain"
VERSION = "0.32.0-fake"
PROMPT_TOKENS = 4  # prompt tokens per request in the /metrics counters
BOS_ID, EOS_ID = 1, 2
GEN_BASE = 100_000  # generated token k has id GEN_BASE + k
VOCAB = 200_000
GSM8K_MODES = ("correct", "wrong", "mixed")
UNKNOWN_ANSWER = " I do not know."
_QUESTION = re.compile(r"Question: (.*?)\nAnswer:", re.S)

Answers = dict[str, tuple[str, int]]  # GSM8K question -> (final answer, row index)


# ---------------------------------------------------------------------- GSM8K answers (pure)
def load_answers(data_dir: Path) -> Answers:
    """Every test question with the number after its answer's ``#### `` and its row index (the
    index decides which rows ``mixed`` gets right)."""
    answers = {}
    lines = (data_dir / "test.jsonl").read_text(encoding="utf-8").splitlines()
    for index, line in enumerate(lines):
        row = json.loads(line)
        answers[row["question"].strip()] = (row["answer"].rsplit("#### ", 1)[-1].strip(), index)
    return answers


def is_right(mode: str, index: int) -> bool:
    """correct: always; wrong: never; mixed: 13 of every 20 rows (0.65, the reference score)."""
    return mode == "correct" or (mode == "mixed" and index % 20 < 13)


def wrong(answer: str) -> str:
    """A number strict-match cannot mistake for ``answer``."""
    try:
        return str(int(answer.replace(",", "")) + 7)
    except ValueError:
        return "-1"


def gsm8k_reply(answers: Answers, mode: str, prompt: str) -> str | None:
    """The completion for a few-shot prompt: its last question is the one asked (the others are
    the shots). None when that question is not in the data."""
    questions = _QUESTION.findall(prompt)
    found = answers.get(questions[-1].strip()) if questions else None
    if found is None:
        return None
    answer, index = found
    final = answer if is_right(mode, index) else wrong(answer)
    return f" Let me think step by step.\n#### {final}\n\n"


def prompt_text(body: dict[str, Any]) -> str | None:
    """The request's one text prompt (a chat's messages joined), or None for a batch or token ids:
    one answer cannot serve several questions."""
    messages = body.get("messages")
    if isinstance(messages, list):
        contents = [m.get("content") for m in messages if isinstance(m, dict)]
        return "\n".join(c for c in contents if isinstance(c, str))
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    return prompt if isinstance(prompt, str) else None


def tokenize(text: str) -> list[int]:
    """The fake tokenizer: BOS, then one id per whitespace-separated word (below GEN_BASE)."""
    return [BOS_ID, *(1000 + zlib.crc32(w.encode()) % 90_000 for w in text.split())]


def render_chat(body: dict[str, Any]) -> str:
    """The fake chat template."""
    parts = []
    for message in body.get("messages") or []:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        role = message.get("role") if isinstance(message, dict) else None
        parts.append(f"<|{role}|> {content or ''}\n")
    if body.get("add_generation_prompt", True):
        parts.append("<|assistant|>")
    return "".join(parts)


def token_text(token_id: int) -> str:
    return f" t{token_id - GEN_BASE}" if token_id >= GEN_BASE else ""


@dataclass
class Generation:
    """What one request generates: token ids, their texts, and how it ended."""

    token_ids: list[int]
    pieces: list[str]
    finish: str
    stop_reason: int | str | None = None


def metrics_text(role: str, ok: int, rejected: int, unknown: int, block_size: int = 128) -> str:
    """The vLLM series the eval's topology probe reads (KV arrived over NIXL on a decode), plus
    the fake's own request counts, which a test reads to prove no request was rejected."""
    source = "local_compute" if role == PREFILL else "external_kv_transfer"
    lines = [
        "# TYPE vllm:cache_config_info gauge",
        f'vllm:cache_config_info{{block_size="{block_size}",engine="0",role="{role}"}} 1.0',
        f'vllm:prompt_tokens_by_source_total{{engine="0",source="{source}"}} {ok * PROMPT_TOKENS}',
        f'vllm:nixl_xfer_time_seconds_count{{engine="0"}} {ok}',
        'vllm:nixl_num_failed_transfers_total{engine="0"} 0',
        f'fake_requests_total{{result="ok"}} {ok}',
        f'fake_requests_total{{result="rejected"}} {rejected}',
        f'fake_requests_total{{result="unknown_question"}} {unknown}',
    ]
    return "\n".join(lines) + "\n"


def prefill_problem(body: dict[str, Any], kv: dict[str, Any]) -> str | None:
    """Why a request is not a P/D prefill leg (vLLM would silently run it as a normal one)."""
    if kv.get("do_remote_decode") is not True:
        return "prefill needs kv_transfer_params.do_remote_decode=true"
    if kv.get("do_remote_prefill") is not False:
        return "prefill needs kv_transfer_params.do_remote_prefill=false"
    if body.get("stream"):
        return "prefill must not stream"
    if body.get("max_tokens") != 1:
        return "prefill needs max_tokens=1"
    # vLLM runs these as several engine requests that each keep KV, and answers one handle.
    n = body.get("n")
    if isinstance(n, int) and n > 1:
        return "prefill with n > 1 would keep n-1 requests' KV nobody reads"
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) > 1 and not isinstance(prompt[0], int):
        return "prefill with several prompts would keep KV nobody reads"
    return None


def sign(secret: bytes, params: dict[str, Any]) -> str:
    """A prefill's signature over the KV handles it issues, which a decode fake checks."""
    fields = ("remote_engine_id", "remote_block_ids", "remote_request_id")
    msg = "|".join(str(params.get(k)) for k in fields)
    return hmac.new(secret, msg.encode(), hashlib.sha256).hexdigest()


def decode_problem(
    kv: dict[str, Any], rid: str, secret: bytes, prefill_engine_id: str | None
) -> str | None:
    """Why ``kv`` are not handles a prefill issued for this very request (and, with
    ``prefill_engine_id``, that engine)."""
    if kv.get("do_remote_prefill") is not True:
        return "decode needs the kv_transfer_params a prefill returned"
    engine = kv.get("remote_engine_id")
    if prefill_engine_id is not None and engine != prefill_engine_id:
        return f"decode kv_transfer_params name engine {engine!r}, not the prefill's"
    if kv.get("remote_request_id") != rid:
        return "decode X-Request-Id differs from the prefill's"
    if not hmac.compare_digest(str(kv.get("fake_signature")), sign(secret, kv)):
        return "decode kv_transfer_params were not issued by a prefill"
    return None


def eval_problem(body: dict[str, Any], model: str) -> str | None:
    """A harness asking for another model, or batching prompts, would score garbage."""
    if body.get("model") != model:
        return f"model {body.get('model')!r} is not served here"
    if prompt_text(body) is None:
        return "one text prompt per request expected"
    return None


def authorized(api_key: str, headers: Mapping[str, str]) -> bool:
    """vLLM's ``--api-key`` check: a bearer token whose SHA-256 matches the key's."""
    scheme, _, token = (headers.get("Authorization") or "").partition(" ")
    if scheme.lower() != "bearer":
        return False
    want = hashlib.sha256(api_key.encode()).digest()
    return hmac.compare_digest(hashlib.sha256(token.encode()).digest(), want)


# ---------------------------------------------------------------------- generation (pure)
def prompt_ids_of(body: dict[str, Any], chat: bool) -> list[int]:
    """The request's prompt as token ids; ``ValueError`` says what vLLM would refuse. A chat's
    ``kv_transfer_params.prompt_token_ids`` is popped from ``body`` (vLLM 0.32's token reuse)."""
    kv = body.get("kv_transfer_params")
    if chat:
        ids = kv.pop("prompt_token_ids", None) if isinstance(kv, dict) else None
        if ids is None:
            return tokenize(render_chat(body))
        if not isinstance(ids, list) or not ids or any(type(x) is not int for x in ids):
            raise ValueError("`kv_transfer_params['prompt_token_ids']` must be a list of ints")
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            prompt = prompt[0]  # a batch: the fake answers its first prompt
        if isinstance(prompt, str):
            return tokenize(prompt)
        ids = prompt
        if not isinstance(ids, list) or not ids or any(type(x) is not int for x in ids):
            raise ValueError("prompt must be a string or token ids")
    if any(not 0 <= x < VOCAB for x in ids):
        raise ValueError(f"token id out of vocabulary (0-{VOCAB - 1})")
    return ids


def block_mismatch(body: dict[str, Any], prompt_len: int, block_size: int) -> str | None:
    """vLLM's NIXL decode asserts its prompt's blocks are no more than the prefill's it reads
    (``_apply_prefix_caching``); the engine dies when they are not. Only a decode checks."""
    kv = body.get("kv_transfer_params")
    if not isinstance(kv, dict) or not kv.get("do_remote_prefill"):
        return None
    groups = kv.get("remote_block_ids") or []
    needed = -(-prompt_len // block_size)
    for group in groups:
        if isinstance(group, list) and needed > len(group):
            return f"AssertionError: {needed} decode blocks > {len(group)} prefill blocks"
    return None


def completion_limit(
    body: dict[str, Any], chat: bool, prompt_len: int, tokens: int, max_model_len: int | None
) -> int:
    """How many tokens a full (not prefill) request may generate: its own limit, else a chat's
    room up to ``max_model_len``, else ``tokens``."""
    value = body.get("max_completion_tokens") if chat else None
    if value is None:
        value = body.get("max_tokens")
    if isinstance(value, int) and value > 0:
        return value
    if chat and max_model_len is not None:
        return max_model_len - prompt_len
    return tokens


def generate(
    body: dict[str, Any], prompt_ids: list[int], limit: int, eos_at: int | None, corrupt: bool
) -> Generation:
    """Numbered tokens, continuing the prompt's own, up to ``limit`` or a stop; ``corrupt``
    answers other text than the model's (as from another request's KV)."""
    last = prompt_ids[-1]
    k = last - GEN_BASE + 1 if last >= GEN_BASE else 0
    min_tokens = body.get("min_tokens") or 0
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    stop_ids = body.get("stop_token_ids") or []
    keep_stop = bool(body.get("include_stop_str_in_output"))
    gen = Generation([], [], "length")
    text = ""
    while len(gen.token_ids) < limit:
        count = len(gen.token_ids)  # this request's tokens so far
        token = GEN_BASE + k
        eos = k == eos_at and not body.get("ignore_eos")
        if count >= min_tokens and (eos or token in stop_ids):
            gen.token_ids.append(EOS_ID if eos else token)
            gen.pieces.append(token_text(token) if keep_stop and not eos else "")
            gen.finish, gen.stop_reason = "stop", None if eos else token
            break
        piece = token_text(token)
        if corrupt:
            piece = piece.replace(" t", " x", 1)
        gen.token_ids.append(token)
        k += 1
        before = len(text)
        text += piece
        if count + 1 > min_tokens:
            found = [(text.find(s, max(0, before - len(s) + 1)), s) for s in stop if s]
            found = [(i, s) for i, s in found if i >= 0]
            if found:
                i, string = min(found)
                end = i + len(string) if keep_stop else i
                gen.pieces.append(piece[: max(0, end - before)])
                gen.finish, gen.stop_reason = "stop", string
                break
        gen.pieces.append(piece)
    return gen


@dataclass
class Answer:
    """One request being answered."""

    rid: str
    chat: bool
    body: dict[str, Any]
    prompt_ids: list[int]
    gen: Generation

    def usage(self, completion_tokens: int) -> dict[str, int]:
        n = len(self.prompt_ids)
        return {
            "prompt_tokens": n,
            "total_tokens": n + completion_tokens,
            "completion_tokens": completion_tokens,
        }


def completion_body(a: Answer, kv: dict[str, Any] | None, model: str) -> dict[str, Any]:
    """The JSON a non-streaming completion (or chat completion) answers, as vLLM 0.32 shapes it."""
    text = "".join(a.gen.pieces)
    ids = a.body.get("return_token_ids")
    choice: dict[str, Any] = (
        {"index": 0, "message": {"role": "assistant", "content": text}}
        if a.chat
        else {"index": 0, "text": text}
    )
    choice["finish_reason"] = a.gen.finish
    choice["stop_reason"] = a.gen.stop_reason
    choice["token_ids"] = a.gen.token_ids if ids else None
    if not a.chat:
        choice["prompt_token_ids"] = a.prompt_ids if ids else None
    data: dict[str, Any] = {
        "id": ("chatcmpl-" if a.chat else "cmpl-") + a.rid,
        "object": "chat.completion" if a.chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": a.usage(len(a.gen.token_ids)),
        "kv_transfer_params": kv,
    }
    if a.chat:
        data["prompt_token_ids"] = a.prompt_ids if ids else None
    return data


def json_copy(obj: Any) -> Any:
    """A deep copy of a JSON value (what a request looked like before it was served)."""
    return json.loads(json.dumps(obj))
