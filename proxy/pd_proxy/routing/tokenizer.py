"""Token ids in the proxy, without a round trip: the served model's ``tokenizer.json`` through the
``tokenizers`` library, and its chat template through Jinja2, rendered as Hugging Face and vLLM
render it (sandboxed, ``trim_blocks``, ``lstrip_blocks``).

A local tokenizer can disagree with the server (a template vLLM overrides, a special-token rule),
so it earns trust per request shape: at start the proxy sends a canary set to a decode's
``/tokenize`` and compares (pd_proxy.routing.cache.router). A shape that disagreed, and every
request this
module cannot reproduce (tools, multimodal parts, a per-request template), go to ``/tokenize``.
Pure apart from reading the tokenizer files once.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jinja2
import jinja2.sandbox
from jinja2.ext import loopcontrols
from tokenizers import Tokenizer

from pd_proxy.protocol.endpoints import CHAT_COMPLETIONS, COMPLETIONS, Endpoint

COMPLETION, CHAT = "completion", "chat"  # the request shapes checked apart
SHAPES = (COMPLETION, CHAT)
# Chat fields the local renderer cannot honour: such requests are tokenized by the server.
SERVER_ONLY_CHAT_FIELDS = (
    "tools",
    "chat_template",
    "chat_template_kwargs",
    "mm_processor_kwargs",
    "media_io_kwargs",
    "documents",
    "continue_final_message",
)
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "pad_token", "unk_token")


class TokenizerFilesError(ValueError):
    """The tokenizer folder lacks a readable ``tokenizer.json``."""


def _raise(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or ``{"content": ...}``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class LocalTokenizer:
    """The model's tokenizer and chat template from a folder of Hugging Face tokenizer files."""

    def __init__(self, folder: str | Path) -> None:
        path = Path(folder)
        try:
            self.tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        except Exception as exc:  # the library raises its own Exception subclass
            raise TokenizerFilesError(f"{path / 'tokenizer.json'}: {exc}") from None
        config = _read_json(path / "tokenizer_config.json")
        self.specials = {
            name: text
            for name in SPECIAL_TOKEN_NAMES
            if (text := _token_text(config.get(name))) is not None
        }
        self.template = _chat_template(path, config)
        self._compiled: jinja2.Template | None = None
        if self.template is not None:
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
            )
            env.filters["tojson"] = lambda x, indent=None: json.dumps(
                x, ensure_ascii=False, indent=indent
            )
            env.globals["raise_exception"] = _raise
            self._compiled = env.from_string(self.template)

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def render_chat(self, messages: list[Mapping[str, Any]], add_generation_prompt: bool) -> str:
        assert self._compiled is not None
        return self._compiled.render(
            messages=messages, add_generation_prompt=add_generation_prompt, **self.specials
        )

    def shape_of(self, body: Mapping[str, Any], endpoint: Endpoint) -> str | None:
        """The shape this module can tokenize ``body`` as, or None (the server must)."""
        if endpoint == COMPLETIONS:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1:
                prompt = prompt[0]
            ok = isinstance(prompt, str) and isinstance(body.get("add_special_tokens", True), bool)
            return COMPLETION if ok else None
        if endpoint != CHAT_COMPLETIONS or self._compiled is None:
            return None
        if any(body.get(k) for k in SERVER_ONLY_CHAT_FIELDS):
            return None
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return None
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("content"), str):
                return None  # content parts, tool calls: the server's content formats
            if not isinstance(m.get("role"), str) or set(m) - {"role", "content", "name"}:
                return None
        flags = (body.get("add_generation_prompt", True), body.get("add_special_tokens", False))
        return CHAT if all(isinstance(f, bool) for f in flags) else None

    def ids(self, body: Mapping[str, Any], endpoint: Endpoint) -> list[int] | None:
        """The prompt's token ids as vLLM would see them, or None when ``shape_of`` says so."""
        shape = self.shape_of(body, endpoint)
        if shape == COMPLETION:
            prompt = body["prompt"]
            text = prompt[0] if isinstance(prompt, list) else prompt
            return self.encode(text, body.get("add_special_tokens", True))
        if shape == CHAT:
            try:
                text = self.render_chat(body["messages"], body.get("add_generation_prompt", True))
            except jinja2.exceptions.TemplateError:
                return None  # the server renders it (and says what is wrong, if anything)
            return self.encode(text, body.get("add_special_tokens", False))
        return None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise TokenizerFilesError(f"{path}: {exc}") from None
    return data if isinstance(data, dict) else {}


def _chat_template(folder: Path, config: Mapping[str, Any]) -> str | None:
    """The default chat template: ``chat_template.jinja`` (newer files) or tokenizer_config.json's
    ``chat_template`` (a string, or a list of named ones: "default")."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


# The canary set checked against a decode's /tokenize at start: (shape, endpoint, request body).
CANARY: tuple[tuple[str, Endpoint, dict[str, Any]], ...] = (
    (COMPLETION, COMPLETIONS, {"prompt": "The capital of France is"}),
    (COMPLETION, COMPLETIONS, {"prompt": "  Leading spaces, ünïcödé, emoji 🙂 and\nnew lines\t."}),
    (COMPLETION, COMPLETIONS, {"prompt": "no specials", "add_special_tokens": False}),
    (CHAT, CHAT_COMPLETIONS, {"messages": [{"role": "user", "content": "Hello there!"}]}),
    (
        CHAT,
        CHAT_COMPLETIONS,
        {
            "messages": [
                {"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Name three colours."},
                {"role": "assistant", "content": "Red, green, blue."},
                {"role": "user", "content": "Two more, ünïcödé ok?"},
            ]
        },
    ),
    (
        CHAT,
        CHAT_COMPLETIONS,
        {"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": False},
    ),
)
