"""Real-format KV-event messages, made by vLLM 0.32's own event classes and msgpack encoder
(``vllm.distributed.kv_events``), so the tests read what a vLLM server publishes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

BLOCK = 4  # a small block size keeps the token lists short


def stored(
    hashes: Sequence[Any],
    parent: Any,
    tokens: Sequence[int],
    block_size: int = BLOCK,
    **extra: Any,
) -> BlockStored:
    fields: dict[str, Any] = {"lora_id": None, "medium": "GPU", "lora_name": None}
    fields.update(extra)
    return BlockStored(
        block_hashes=list(hashes),
        parent_block_hash=parent,
        token_ids=list(tokens),
        block_size=block_size,
        **fields,
    )


def removed(hashes: Sequence[Any]) -> BlockRemoved:
    return BlockRemoved(block_hashes=list(hashes), medium="GPU")


def cleared() -> AllBlocksCleared:
    return AllBlocksCleared()


def batch(*events: Any, ts: float = 1.0) -> KVEventBatch:
    return KVEventBatch(ts=ts, events=list(events), data_parallel_rank=0)


def frames(seq: int, *events: Any, topic: bytes = b"kv") -> list[bytes]:
    """One published message: topic, 8-byte sequence, msgpack batch (as ZmqEventPublisher)."""
    payload = msgspec.msgpack.Encoder().encode(batch(*events))
    return [topic, seq.to_bytes(8, "big"), payload]


def blocks(n: int, start: int = 100) -> list[int]:
    """``n`` blocks worth of distinct token ids."""
    return list(range(start, start + n * BLOCK))


def vllm_extra_keys(
    n_blocks: int,
    salt: str | None = None,
    lora: str | None = None,
    mm: Sequence[tuple[str, int, int]] = (),
    first_block: int = 0,
) -> list[Any] | None:
    """The ``extra_keys`` a BlockStored event carries for blocks ``first_block`` onwards of a
    request, made by vLLM's own ``generate_block_hash_extra_keys`` and ``to_event_extra_keys``
    (``mm``: (identifier, offset, length) of each multimodal item)."""
    from types import SimpleNamespace

    from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys, to_event_extra_keys

    request = SimpleNamespace(
        cache_salt=salt,
        lora_request=None if lora is None else SimpleNamespace(lora_name=lora, lora_path="/a"),
        mm_features=[
            SimpleNamespace(identifier=i, mm_position=SimpleNamespace(offset=o, length=n))
            for i, o, n in mm
        ],
        prompt_embeds=None,
    )
    keys, mm_idx = [], 0
    for i in range(first_block, first_block + n_blocks):
        extra, mm_idx = generate_block_hash_extra_keys(request, i * BLOCK, (i + 1) * BLOCK, mm_idx)
        keys.append(extra)
    return to_event_extra_keys(keys)
