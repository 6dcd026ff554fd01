"""One replica's KV-event stream into its ``ReplicaIndex``: a ZMQ SUB socket on the publisher, and
a DEALER on its replay ROUTER to fill gaps (pyzmq's asyncio sockets).

A gap (a sequence number skipped) asks the replay socket for the missing batches; if they do not
all come back in ``replay_timeout`` seconds (no replay endpoint, the buffer moved on, the replica
is gone), the replica's entries are dropped: a lost ``BlockRemoved`` would otherwise leave the
index claiming blocks the replica no longer holds. A batch that does not decode counts as a gap
too. The first batch a subscription sees (after the proxy or the publisher started) asks for a
replay from 0, so neither restart leaves the index blind to what came before it connected.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import zmq
import zmq.asyncio

from pd_proxy.routing.cache.events import END_SEQ, BadBatch, Batch, decode
from pd_proxy.routing.cache.index import GAP, RESET, ReplicaIndex
from pd_proxy.routing.cache.publishers import Publisher

log = logging.getLogger("pd_proxy.routing.cache")


class Subscription:
    """Feeds ``index`` from ``publisher`` until ``close``; ``on_batch(replica, batch, verdict)``
    is told of each batch applied (metrics)."""

    def __init__(
        self,
        replica: str,
        publisher: Publisher,
        index: ReplicaIndex,
        ctx: zmq.asyncio.Context,
        replay_timeout: float,
        on_batch: Callable[[str, Batch, str], None] | None = None,
    ) -> None:
        self.replica = replica
        self.publisher = publisher
        self.index = index
        self.ctx = ctx
        self.replay_timeout = replay_timeout
        self.on_batch = on_batch
        self.received_at: float | None = None  # monotonic time of the last batch
        self._sub = ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, publisher.topic.encode())
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.connect(publisher.endpoint)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self.run(), name=f"kv-events {self.replica}")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        self._sub.close(linger=0)

    async def run(self) -> None:
        while True:
            frames = await self._sub.recv_multipart()
            try:
                await self.handle(frames)
            except Exception:  # one bad batch must not end the subscription
                log.exception("kv events from %s: batch failed; entries dropped", self.replica)
                self.index.drop(None)

    async def handle(self, frames: list[bytes]) -> None:
        index = self.index
        self.received_at = time.monotonic()
        try:
            batch = decode(frames)
        except BadBatch as exc:
            index.health.gaps += 1
            log.warning("kv events from %s: %s; its entries are dropped", self.replica, exc)
            index.drop(None)
            return
        first = index.expected is None and index.health.batches == 0
        verdict = index.accept(batch.seq)
        if verdict == RESET:
            log.info("kv events from %s: sequence restarted at %d", self.replica, batch.seq)
            index.restart()
            first = True  # the new publisher's first batches may have gone before we heard it
        if first and batch.seq > 0 and self.publisher.replay is not None:
            await self._fill(0, batch.seq, strict=False)
        elif verdict == GAP:
            index.health.gaps += 1
            assert index.expected is not None
            await self._fill(index.expected, batch.seq, strict=True)
        index.apply(batch)
        if self.on_batch is not None:
            self.on_batch(self.replica, batch, verdict)

    async def _fill(self, start: int, stop: int, strict: bool) -> None:
        """Apply the batches ``start``..``stop - 1`` from the replay socket; with ``strict`` (a
        gap in a stream the index followed), anything missing drops the replica's entries."""
        got = await self.replay(start, stop)
        index = self.index
        expect = got[0].seq if got and not strict else start
        complete = bool(got) and all(b.seq == expect + i for i, b in enumerate(got))
        complete = complete and got[-1].seq == stop - 1
        if complete:
            for b in got:
                index.apply(b)
            index.health.replays += 1
            return
        if strict:
            log.warning(
                "kv events from %s: batches %d-%d lost and not replayed; entries dropped",
                self.replica,
                start,
                stop - 1,
            )
            index.drop(stop)
        else:
            index.expected = stop

    async def replay(self, start: int, stop: int) -> list[Batch]:
        """The batches ``start``..``stop - 1`` the publisher still buffers (empty on failure)."""
        if self.publisher.replay is None:
            return []
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        out: list[Batch] = []
        try:
            dealer.connect(self.publisher.replay)
            await dealer.send_multipart((b"", start.to_bytes(8, "big")))
            deadline = time.monotonic() + self.replay_timeout
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not await dealer.poll(left * 1000):
                    log.warning("kv events from %s: replay timed out", self.replica)
                    return []
                # (empty delimiter, topic, sequence, payload); the end: an empty topic, seq -1
                frames = await dealer.recv_multipart()
                if len(frames) != 4:
                    return []
                if frames[2] == END_SEQ:
                    return out
                batch = decode(frames[1:])
                if start <= batch.seq < stop:
                    out.append(batch)
        except (BadBatch, zmq.ZMQError) as exc:
            log.warning("kv events from %s: replay failed: %s", self.replica, exc)
            return []
        finally:
            dealer.close(linger=0)
