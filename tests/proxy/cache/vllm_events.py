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
