"""vLLM's KV-event messages as plain records (``vllm/distributed/kv_events.py``, 0.32).

One ZMQ message is three frames: the topic, an 8-byte big-endian sequence number, and a msgpack
batch ``[ts, events, dp_rank]``. Each event is a map tagged ``type``: ``BlockStored``,
``BlockRemoved`` or ``AllBlocksCleared``. Older publishers sent events as positional arrays; a
batch in any other shape raises ``BadBatch`` so the caller treats it as lost, never guesses.
Pure: bytes in, records out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from pd_proxy.routing.cache.keys import Extra, block_extra

BlockHash = bytes | int  # vLLM's ExternalBlockHash
# The replay socket's end-of-replay marker: sequence -1.
END_SEQ = (-1).to_bytes(8, "big", signed=True)
# The tier a decode reads hits from; blocks offloaded to other tiers are not counted as hits.
GPU_MEDIUM = "GPU"


class BadBatch(ValueError):
    """A message that is not a vLLM 0.32 KV-event batch."""


@dataclass(frozen=True)
class Stored:
    block_hashes: tuple[BlockHash, ...]
    parent: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    # Per block, what besides tokens went into vLLM's hash (LoRA, cache_salt, multimodal,
    # prompt embeds) as pd_proxy.routing.cache.keys spells it; None: every block plain.
    extras: tuple[Extra, ...] | None


@dataclass(frozen=True)
class Removed:
    block_hashes: tuple[BlockHash, ...]


@dataclass(frozen=True)
class Cleared:
    pass


Event = Stored | Removed | Cleared


@dataclass(frozen=True)
class Batch:
    seq: int
    ts: float
    events: tuple[Event, ...]
    dp_rank: int | None


def sequence(frame: bytes) -> int:
    """The sequence number frame: 8 bytes big-endian (-1 is the replay's end marker)."""
    if len(frame) != 8:
        raise BadBatch(f"sequence frame of {len(frame)} bytes, not 8")
    return int.from_bytes(frame, "big", signed=True)


def decode(frames: Sequence[bytes]) -> Batch:
    """A published (or replayed) message's three frames as a ``Batch``."""
    if len(frames) != 3:
        raise BadBatch(f"{len(frames)} frames, not 3 (topic, sequence, payload)")
    seq = sequence(frames[1])
    try:
        raw = msgpack.unpackb(frames[2], raw=False, strict_map_key=False)
    except (ValueError, msgpack.UnpackException) as exc:
        raise BadBatch(f"payload is not msgpack: {exc}") from None
    if not isinstance(raw, list) or len(raw) not in (2, 3) or not isinstance(raw[1], list):
        raise BadBatch("payload is not a [ts, events, dp_rank] batch")
    ts = raw[0]
    if not isinstance(ts, (int, float)):
        raise BadBatch("batch timestamp is not a number")
    rank = raw[2] if len(raw) == 3 else None
    events = tuple(e for e in (event(x) for x in raw[1]) if e is not None)
    return Batch(seq, float(ts), events, rank if isinstance(rank, int) else None)


def event(raw: Any) -> Event | None:
    """One map-shaped event; None for an event of a tier or group the index does not track."""
    if not isinstance(raw, dict):
        raise BadBatch("event is not a map tagged 'type' (a pre-0.32 positional event?)")
    kind = raw.get("type")
    if kind == "AllBlocksCleared":
        return Cleared()
    hashes = raw.get("block_hashes")
    if not isinstance(hashes, list):
        raise BadBatch(f"{kind} without block_hashes")
    if not _tracked(raw):
        return None
    if kind == "BlockRemoved":
        return Removed(tuple(hashes))
    if kind != "BlockStored":
        raise BadBatch(f"unknown event type {kind!r}")
    tokens = raw.get("token_ids")
    size = raw.get("block_size")
    if not isinstance(tokens, list) or not isinstance(size, int) or size <= 0:
        raise BadBatch("BlockStored without token_ids or block_size")
    if len(tokens) != size * len(hashes):
        raise BadBatch(f"BlockStored: {len(tokens)} tokens for {len(hashes)} blocks of {size}")
    extras = _extras(raw, len(hashes))
    return Stored(tuple(hashes), raw.get("parent_block_hash"), tuple(tokens), size, extras)


def _tracked(raw: dict[str, Any]) -> bool:
    """The device tier of the first KV cache group (the only group of the models served here)."""
    medium = raw.get("medium")
    group = raw.get("group_idx")
    return medium in (None, GPU_MEDIUM) and group in (None, 0)


def _extras(raw: dict[str, Any], blocks: int) -> tuple[Extra, ...] | None:
    """Each block's extra keys, tagged as the proxy's keys spell them, or None when all are plain.

    vLLM publishes them untagged, one entry per block (``to_event_extra_keys``): the LoRA name
    first when ``lora_name`` is set, then multimodal ``(identifier, offset)`` pairs, the
    ``cache_salt`` string (first block only) and prompt-embeds digests (bytes). After the LoRA
    name, a string is the salt; anything else is content the proxy cannot key from a request
    ("other"), so such blocks never match one.
    """
    lora = raw.get("lora_name")
    if lora is None and raw.get("lora_id") is not None:
        lora = ("id", raw.get("lora_id"))  # no name to meet a request's model: never matches
    entries = raw.get("extra_keys")
    if lora is None and (entries is None or (isinstance(entries, list) and not any(entries))):
        return None  # the common case, plain blocks: no per-block work
    if not isinstance(entries, list) or len(entries) != blocks:
        if entries is not None and isinstance(entries, list) and any(e for e in entries):
            # Not one entry per block: key every block apart rather than guess which is which.
            return tuple(block_extra(None, None, ("unaligned",)) for _ in range(blocks))
        entries = [None] * blocks
    out = tuple(_block(lora, entry) for entry in entries)
    return None if all(e is None for e in out) else out


def _block(lora: Any, entry: Any) -> Extra:
    parts = list(entry) if isinstance(entry, list | tuple) else []
    if lora is not None and parts and parts[0] == lora:
        parts = parts[1:]
    salts = [p for p in parts if isinstance(p, str)]
    other = tuple(_frozen(p) for p in parts if not isinstance(p, str))
    if len(salts) > 1:
        other += tuple(salts)  # vLLM adds one salt at most: unknown content, keyed apart
        salts = []
    name = lora if isinstance(lora, str) or lora is None else None
    if lora is not None and name is None:
        other += (lora,)
    return block_extra(name, salts[0] if salts else None, other)


def _frozen(value: Any) -> Any:
    """Lists as tuples, all the way down, so the value can be part of a hashable key."""
    if isinstance(value, list | tuple):
        return tuple(_frozen(v) for v in value)
    return value
