"""What besides token ids vLLM hashes into a request's blocks, read from the request body.

vLLM 0.32 (``generate_block_hash_extra_keys``) adds ``cache_salt`` to the first block's extra
keys, a LoRA adapter to every block's, and multimodal or prompt-embeds hashes to the blocks they
cover. The proxy keys a request's blocks the same way (pd_proxy.routing.cache.keys), so a salted
request is predicted only from blocks stored under its own salt. Multimodal content and prompt
embeds cannot be keyed from the body: such a request is never predicted a hit. Pure.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pd_proxy.routing.cache.keys import Extra, block_extra


@dataclass(frozen=True, slots=True)
class RequestKeys:
    """A request's extra keys: its salt, its ``model`` (a LoRA adapter's name when the replicas'
    events name it one), and whether its blocks can be keyed at all."""

    salt: str | None = None
    model: str | None = None
    keyable: bool = True

    def extras(self, blocks: int, is_adapter: Callable[[str], bool]) -> list[Extra] | None:
        """Each block's extra keys for a prompt of ``blocks`` whole blocks (None: all plain)."""
        model = self.model
        lora = model if model is not None and is_adapter(model) else None
        first = block_extra(lora, self.salt)
        if lora is None:
            return None if first is None else [first]
        return [first] + [block_extra(lora, None)] * max(blocks - 1, 0)


PLAIN = RequestKeys()
UNKEYABLE = RequestKeys(keyable=False)


def request_keys(body: Mapping[str, Any]) -> RequestKeys:
    """The extra keys of a completions or chat request body."""
    salt = body.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        return UNKEYABLE  # vLLM refuses it; nothing to predict
    if "prompt_embeds" in body or _multimodal(body.get("messages")):
        return UNKEYABLE
    model = body.get("model")
    return RequestKeys(salt or None, model if isinstance(model, str) else None)


def _multimodal(messages: Any) -> bool:
    """Whether a chat carries content other than text (images, audio, video, embeddings)."""
    if not isinstance(messages, list):
        return False
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list) and any(
            not isinstance(part, dict) or part.get("type") != "text" for part in content
        ):
            return True
    return False
