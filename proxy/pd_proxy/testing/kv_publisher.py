"""KV events published the way vLLM 0.32's ``ZmqEventPublisher`` publishes them
(``vllm/distributed/kv_events.py``), for fake replicas that stand in for a fleet.

The wire: three frames per batch (topic, an 8-byte big-endian sequence number counted from 0,
msgpack ``[ts, events, dp_rank]``); events are maps tagged ``type`` with the fields vLLM's
block pool sets (``BlockStored`` one per request and step with its new full blocks,
``BlockRemoved`` one per evicted block, ``group_idx`` 0, ``medium`` ``"GPU"``); hashes are 64-bit
ints of the content (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``), alike on every replica. A ROUTER
socket replays the last ``buffer_steps`` batches from a requested number, then sends the end
marker (an empty topic, sequence -1). Events are packed once and a batch is their concatenation
behind a fresh timestamp, so one process can publish tens of thousands a second. The encoding is
pure; ``Publisher`` owns the sockets and is served from its owner's loop (``serve_replays``), as
vLLM's thread serves replays between sends.
"""

from __future__ import annotations

import hashlib
import struct
import time
from array import array
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any

import msgpack
import zmq

TOPIC = "kv"
BUFFER_STEPS = 10_000  # vLLM's default replay buffer, in batches
HWM = 100_000  # vLLM's default high-water mark of the PUB socket
MEDIUM = "GPU"
END_SEQ = (-1).to_bytes(8, "big", signed=True)
_TS = struct.Struct(">Bd")  # msgpack float 64 (0xcb), how msgspec writes a float


def block_hash(parent: int | None, tokens: Sequence[int]) -> int:
    """A block's 64-bit hash from its parent's and its token ids, as vLLM chains them."""
    digest = hashlib.blake2b((parent or 0).to_bytes(8, "big"), digest_size=8)
    digest.update(array("q", tokens).tobytes())
    return int.from_bytes(digest.digest(), "big")


def stored(hashes: Sequence[int], parent: int | None, tokens: Sequence[int], size: int) -> bytes:
    """A packed ``BlockStored``, its fields in vLLM's order (defaults left out, as msgspec's
    ``omit_defaults``)."""
    return pack_event(
        {
            "type": "BlockStored",
            "block_hashes": list(hashes),
            "parent_block_hash": parent,
            "token_ids": list(tokens),
            "block_size": size,
            "lora_id": None,
            "medium": MEDIUM,
            "lora_name": None,
            "group_idx": 0,
        }
    )


def removed(block: int) -> bytes:
    """A packed ``BlockRemoved`` of one block, as vLLM's block pool emits each eviction."""
    return pack_event({"type": "BlockRemoved", "block_hashes": [block], "medium": MEDIUM,
                       "group_idx": 0})  # fmt: skip


def pack_event(event: dict[str, Any]) -> bytes:
    return msgpack.packb(event, use_bin_type=True)


def prompt_events(tokens: Sequence[int], size: int, per_event: int = 0) -> list[bytes]:
    """The ``BlockStored`` events of a prompt's full blocks, chained from the root: one event of
    every block (a prefill's step), or ``per_event`` blocks each."""
    blocks = len(tokens) // size
    step = per_event or max(blocks, 1)
    out: list[bytes] = []
    parent: int | None = None
    for first in range(0, blocks, step):
        last = min(first + step, blocks)
        hashes: list[int] = []
        for i in range(first, last):
            hashes.append(
                block_hash(hashes[-1] if hashes else parent, tokens[i * size : (i + 1) * size])
            )
        out.append(stored(hashes, parent, tokens[first * size : last * size], size))
        parent = hashes[-1]
    return out


def array_header(n: int) -> bytes:
    """msgpack's header of an array of ``n`` items."""
    if n < 16:
        return bytes((0x90 | n,))
    if n < 1 << 16:
        return b"\xdc" + n.to_bytes(2, "big")
    return b"\xdd" + n.to_bytes(4, "big")


def batch_payload(ts: float, events: Sequence[bytes], dp_rank: int = 0) -> bytes:
    """``KVEventBatch(ts, events, data_parallel_rank)`` as msgspec encodes it (an array of
    three), from events already packed."""
    return (
        b"\x93"
        + _TS.pack(0xCB, ts)
        + array_header(len(events))
        + b"".join(events)
        + (msgpack.packb(dp_rank))
    )


class Publisher:
    """One engine's publisher on loopback: PUB for the live stream, ROUTER for replays."""

    def __init__(self, ctx: zmq.Context, host: str = "127.0.0.1", topic: str = TOPIC,
                 buffer_steps: int = BUFFER_STEPS) -> None:  # fmt: skip
        self.host = host
        self.topic = topic.encode()
        self.pub = ctx.socket(zmq.PUB)
        self.pub.set_hwm(HWM)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.port = self.pub.bind_to_random_port(f"tcp://{host}")
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.replay_port = self.router.bind_to_random_port(f"tcp://{host}")
        self.buffer_steps = buffer_steps
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.seq = 0
        self.events = 0  # published since the last restart
        self.last_sent = 0.0  # monotonic time of the last batch

    def config(self) -> dict[str, Any]:
        """Its ``KVEventsConfig`` as ``GET /kv_event_sources`` answers it; the endpoints written
        IPv4-mapped, the kit's form of a loopback publisher vLLM binds."""
        return {"enable_kv_cache_events": True, "publisher": "zmq",
                "endpoint": f"tcp://[::ffff:{self.host}]:{self.port}",
                "replay_endpoint": f"tcp://[::ffff:{self.host}]:{self.replay_port}",
                "buffer_steps": self.buffer_steps, "hwm": HWM, "max_queue_size": 100_000,
                "topic": self.topic.decode()}  # fmt: skip

    def publish(self, events: Sequence[bytes], ts: float | None = None) -> None:
        """Send one batch now (stamped with the wall clock, as vLLM's scheduler stamps it)."""
        payload = batch_payload(time.time() if ts is None else ts, events)
        self.pub.send_multipart((self.topic, self.seq.to_bytes(8, "big"), payload))
        self.buffer.append((self.seq, payload))
        self.seq += 1
        self.events += len(events)
        self.last_sent = time.monotonic()

    def serve_replays(self) -> None:
        """Answer the replay requests waiting: every buffered batch from the asked number on."""
        while self.router.poll(0):
            frames = self.router.recv_multipart()
            if len(frames) != 3:
                continue
            client, _, start = frames
            first = int.from_bytes(start, "big")
            for seq, payload in self.buffer:
                if seq >= first:
                    self.router.send_multipart((client, b"", self.topic, seq.to_bytes(8, "big"),
                                                payload))  # fmt: skip
            self.router.send_multipart((client, b"", b"", END_SEQ, b""))

    def restart(self) -> None:
        """As a restarted engine: an empty cache, sequence numbers from 0, nothing to replay."""
        self.buffer.clear()
        self.seq = 0
        self.events = 0

    def close(self) -> None:
        self.pub.close(linger=0)
        self.router.close(linger=0)


def publish_all(publishers: Iterable[Publisher], events: Sequence[bytes]) -> None:
    for publisher in publishers:
        publisher.publish(events)
