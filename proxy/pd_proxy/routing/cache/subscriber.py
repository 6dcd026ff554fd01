"""One replica's KV-event stream into its ``ReplicaIndex``: a ZMQ SUB socket on the publisher, and
a DEALER on its replay ROUTER to fill gaps (pyzmq's asyncio sockets).

A gap (a sequence number skipped) asks the replay socket for the missing batches; if they do not
all come back in ``replay_timeout`` seconds (no replay endpoint, the buffer moved on, the replica
is gone), the replica's entries are dropped: a lost ``BlockRemoved`` would otherwise leave the
index claiming blocks the replica no longer holds. A batch that does not decode counts as a gap
too. The first batch a subscription sees (after the proxy or the publisher started) asks for a
replay from 0, so neither restart leaves the index blind to what came before it connected.

A subscription to a stream the index has not followed yet first asks for the whole replay buffer
(``catch_up``), so a proxy that restarts beside idle replicas learns what they hold without
waiting for their next batch; ``caught_up`` is then true, or once a first batch is applied (the
proxy's readiness waits for it, pd_proxy.routing.cache.follow). Batches queued on the socket are
read without the asyncio wrapper (its future per message cost more than a one-event batch) and
handled in a run while the subscriptions' shared slice of the event loop lasts
(pd_proxy.routing.cache.loop_share), so a flood of events delays a relay by about one slice.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import zmq
import zmq.asyncio

from pd_proxy.routing.cache.events import END_SEQ, BadBatch, Batch, decode, sequence
from pd_proxy.routing.cache.index import GAP, NEXT, RESET, ReplicaIndex
from pd_proxy.routing.cache.loop_share import LoopShare
from pd_proxy.routing.cache.publishers import Publisher

log = logging.getLogger("pd_proxy.routing.cache")

CATCH_UP_YIELD = 256  # replayed batches applied between yields
EVERYTHING = 1 << 62  # a replay's end: all the buffer holds


class Subscription:
    """Feeds ``index`` from ``publisher`` until ``close``; ``on_batch(replica, batch, verdict)``
    is told of each batch applied (metrics)."""

    def __init__(
        self,
        replica: str,
        publisher: Publisher,
        index: ReplicaIndex,
        ctx: zmq.asyncio.Context,
        *,
        replay_timeout: float,
        on_batch: Callable[[str, Batch, str], None] | None = None,
        share: LoopShare | None = None,
    ) -> None:
        self.replica = replica
        self.share = LoopShare() if share is None else share  # the follower's, for all of them
        self.publisher = publisher
        self.index = index
        self.ctx = ctx
        self.replay_timeout = replay_timeout
        self.on_batch = on_batch
        self.received_at: float | None = None  # monotonic time of the last batch
        self.caught_up = False  # replayed at the start, or a first batch applied
        self._replayed_to: int | None = None  # live batches up to this came in the catch-up
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
        await self.catch_up()
        await self._skip_replayed()
        sub = self._sub
        # The same socket without the asyncio wrapper: what is queued is read at a fraction of
        # the cost of an awaited receive (the wrapper's future per message).
        queued = zmq.Socket.shadow(sub.underlying)
        share = self.share
        while True:
            try:
                frames = queued.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                frames = await sub.recv_multipart()  # waits, or returns at once if one came
            await share.turn()  # a flood must not hold the event loop
            await self._handle_safely(frames)

    async def _handle_safely(self, frames: list[bytes]) -> None:
        try:
            await self.handle(frames)
        except Exception:  # one bad batch must not end the subscription
            log.exception("kv events from %s: batch failed; entries dropped", self.replica)
            self.index.drop(None)

    async def catch_up(self) -> None:
        """A stream new to the index: apply all the replay buffer holds before the first live
        batch (a publisher without a replay socket is caught up at its first batch)."""
        index = self.index
        if index.expected is not None or index.health.batches or self.publisher.replay is None:
            return
        got = await self.replay(0, EVERYTHING)
        if got is None:
            return  # no answer: caught up at the first batch, its replay from 0
        for i, b in enumerate(got):
            if i and b.seq != got[i - 1].seq + 1:
                index.drop(None)  # the buffer skipped: what came before is unknown
                return
            index.apply(b)
            if i % CATCH_UP_YIELD == CATCH_UP_YIELD - 1:
                await asyncio.sleep(0)
        if got:
            index.health.replays += 1
            self._replayed_to = got[-1].seq
            if self.on_batch is not None:
                self.on_batch(self.replica, got[-1], NEXT)
        self.caught_up = True

    async def _skip_replayed(self) -> None:
        """The batches queued on the socket while the catch-up ran, up to the last replayed, were
        applied from the replay: skip them (a later one, even numbered lower, is a restart)."""
        last, self._replayed_to = self._replayed_to, None
        if last is None:
            return
        while await self._sub.poll(0):
            frames = await self._sub.recv_multipart()
            if len(frames) == 3 and len(frames[1]) == 8 and sequence(frames[1]) <= last:
                continue
            await self.handle(frames)
            return

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
        self.caught_up = True
        if self.on_batch is not None:
            self.on_batch(self.replica, batch, verdict)

    async def _fill(self, start: int, stop: int, strict: bool) -> None:
        """Apply the batches ``start``..``stop - 1`` from the replay socket; with ``strict`` (a
        gap in a stream the index followed), anything missing drops the replica's entries."""
        got = await self.replay(start, stop) or []
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

    async def replay(self, start: int, stop: int) -> list[Batch] | None:
        """The batches ``start``..``stop - 1`` the publisher still buffers (None on failure)."""
        if self.publisher.replay is None:
            return None
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
                    return None
                # (empty delimiter, topic, sequence, payload); the end: an empty topic, seq -1
                frames = await dealer.recv_multipart()
                if len(frames) != 4:
                    return None
                if frames[2] == END_SEQ:
                    return out
                batch = decode(frames[1:])
                if start <= batch.seq < stop:
                    out.append(batch)
        except (BadBatch, zmq.ZMQError) as exc:
            log.warning("kv events from %s: replay failed: %s", self.replica, exc)
            return None
        finally:
            dealer.close(linger=0)
