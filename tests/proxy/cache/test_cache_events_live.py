"""vLLM 0.32's own ``ZmqEventPublisher`` publishes on loopback to the proxy's subscriber: the
first batches, a gap filled by replay, a gap the replay buffer no longer covers (entries dropped,
never left stale) and a publisher restart (sequence reset clears the index)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
import zmq.asyncio

from pcp_pd_kit.localstack.commands import kv_events_endpoint
from pcp_pd_kit.localstack.host import free_port
from pd_proxy.routing.cache.index import ReplicaIndex
from pd_proxy.routing.cache.keys import chain
from pd_proxy.routing.cache.publishers import Publisher, parse_sources
from pd_proxy.routing.cache.subscriber import Subscription

from .vllm_events import BLOCK, batch, blocks, removed, stored

pytestmark = pytest.mark.vllm
TOPIC = "kv"


class Stream:
    """A real publisher on two loopback ports and the proxy's subscriptions to it."""

    def __init__(self, buffer_steps: int = 1000, host: str = "*") -> None:
        self.port, self.replay_port = free_port(), free_port()
        self.buffer_steps = buffer_steps
        self.endpoint = f"tcp://{host}:{self.port}"
        self.replay_endpoint = f"tcp://{host}:{self.replay_port}"
        if host != "*":  # the local stack's form (pcp_pd_kit.localstack.commands)
            self.endpoint = kv_events_endpoint(host, self.port)
            self.replay_endpoint = kv_events_endpoint(host, self.replay_port)
        self.pub = self._publisher()
        self.ctx = zmq.asyncio.Context()
        self.index = ReplicaIndex()
        self.sub: Subscription | None = None

    def _publisher(self):
        from vllm.distributed.kv_events import ZmqEventPublisher

        return ZmqEventPublisher(
            0,
            endpoint=self.endpoint,
            replay_endpoint=self.replay_endpoint,
            buffer_steps=self.buffer_steps,
            topic=TOPIC,
        )

    async def restarted(self):
        """A new publisher on the same ports, once ZMQ has let the old ones go."""
        for _ in range(50):
            try:
                return self._publisher()
            except zmq.ZMQError:
                await asyncio.sleep(0.1)
        return self._publisher()

    def connect(self, where: Publisher | None = None) -> None:
        where = where or Publisher(
            0, f"tcp://127.0.0.1:{self.port}", f"tcp://127.0.0.1:{self.replay_port}", TOPIC
        )
        self.sub = Subscription("replica", where, self.index, self.ctx, replay_timeout=5.0)
        self.sub.start()

    async def disconnect(self) -> None:
        assert self.sub is not None
        await self.sub.close()
        self.sub = None

    def publish(self, *events) -> None:
        self.pub.publish(batch(*events))

    async def sent(self) -> None:
        """Wait until the publisher's thread has sent everything queued (to no one, while
        disconnected). vLLM's thread marks each batch done only after sending it, so this is
        exact; a sleep was not, on a loaded host (a subscriber that connected first got the
        batch live and the replay the test is about never happened)."""
        await asyncio.wait_for(asyncio.to_thread(self.pub._event_queue.join), timeout=30)

    async def until(self, done: Callable[[], bool], heartbeat: bool = True) -> None:
        """Publish empty batches (one per engine step, as vLLM's) until ``done``: a SUB socket
        that just connected misses what was sent before, as it would in production."""
        for _ in range(200):
            if done():
                return
            if heartbeat:
                self.publish()
            await asyncio.sleep(0.05)
        raise AssertionError(f"not reached; health {self.index.health}")

    async def close(self) -> None:
        if self.sub is not None:
            await self.disconnect()
        self.pub.shutdown()
        self.ctx.term()


def keys(prompt: list[int]) -> list[int]:
    return chain(prompt, BLOCK)


async def test_gap_is_replayed_and_nothing_is_lost() -> None:
    s = Stream()
    try:
        a, b = blocks(2), blocks(2, start=500)
        s.publish(stored([b"a1", b"a2"], None, a))  # before anyone listens: replayed from 0
        await s.sent()
        s.connect()
        await s.until(lambda: s.index.match(keys(a)) == 2)
        await s.disconnect()
        s.publish(stored([b"b1", b"b2"], None, b))  # both lost on the live stream...
        s.publish(removed([b"a2"]))
        await s.sent()
        s.connect()
        await s.until(lambda: s.index.health.gaps >= 1 and s.index.match(keys(b)) == 2)
        assert s.index.match(keys(a)) == 1  # ...but the removal was replayed too
        assert s.index.health.drops == 0 and s.index.health.replays >= 2
    finally:
        await s.close()


async def test_gap_the_replay_buffer_lost_drops_the_replica() -> None:
    s = Stream(buffer_steps=2)
    try:
        a = blocks(2)
        s.connect()
        await s.until(lambda: s.index.health.batches > 0)
        s.publish(stored([b"a1", b"a2"], None, a))
        await s.until(lambda: s.index.match(keys(a)) == 2, heartbeat=False)
        await s.disconnect()
        s.publish(removed([b"a1", b"a2"]))  # evicted from the 2-batch buffer by what follows
        for _ in range(4):
            s.publish()
        await s.sent()
        s.connect()
        await s.until(lambda: s.index.health.drops >= 1)
        assert s.index.match(keys(a)) == 0  # dropped: never a stale claim
        c = blocks(1, start=900)
        s.publish(stored([b"c1"], None, c))  # and it goes on from there
        await s.until(lambda: s.index.match(keys(c)) == 1, heartbeat=False)
    finally:
        await s.close()


async def test_publisher_restart_clears_the_index() -> None:
    s = Stream()
    try:
        a, b = blocks(2), blocks(1, start=700)
        s.connect()
        for _ in range(5):
            s.publish()
        s.publish(stored([b"a1", b"a2"], None, a))
        await s.until(lambda: s.index.match(keys(a)) == 2)
        s.pub.shutdown()  # the replica restarts: same ports, sequence from 0, empty cache
        s.pub = await s.restarted()
        s.publish(stored([b"b1"], None, b))
        await s.until(lambda: s.index.health.resets >= 1 and s.index.match(keys(b)) == 1)
        assert s.index.match(keys(a)) == 0
    finally:
        await s.close()


async def test_the_local_stacks_endpoints_stay_on_loopback_and_reach_the_proxy() -> None:
    """The local stack's endpoint form makes vLLM's publisher bind (not connect), on 127.0.0.1
    alone; the proxy reads it from /kv_event_sources, follows it from a replica it reaches on
    loopback, and refuses it from one it reaches elsewhere."""
    import psutil

    s = Stream(host="127.0.0.1")
    try:
        listening = {
            (c.laddr[0], c.laddr[1])
            for c in psutil.Process().net_connections("tcp")
            if c.status == psutil.CONN_LISTEN
        }
        assert ("127.0.0.1", s.port) in listening
        assert ("127.0.0.1", s.replay_port) in listening
        answer = {
            "0": {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": s.endpoint,
                "replay_endpoint": s.replay_endpoint,
                "topic": TOPIC,
            }
        }
        publishers, problems = parse_sources(answer, "127.0.0.1")
        assert problems == []
        assert publishers == [
            Publisher(0, f"tcp://127.0.0.1:{s.port}", f"tcp://127.0.0.1:{s.replay_port}", TOPIC)
        ]
        a = blocks(2)
        s.publish(stored([b"a1", b"a2"], None, a))  # before anyone listens: replayed
        await s.sent()
        s.connect(publishers[0])
        await s.until(lambda: s.index.health.replays >= 1)
        await s.until(lambda: s.index.match(keys(a)) == 2)
        elsewhere, problems = parse_sources(answer, "10.1.2.3")
        assert elsewhere == [] and "where the proxy can reach it" in problems[0]
    finally:
        await s.close()


async def test_a_new_subscription_catches_up_from_the_replay_alone() -> None:
    """A proxy restarted beside an idle replica: nothing is published after it connects, yet
    the replay buffer tells it what the replica holds, and the subscription is caught up."""
    s = Stream()
    try:
        a = blocks(3)
        s.publish(stored([b"a1", b"a2", b"a3"], None, a))
        await s.sent()
        s.connect()
        await s.until(lambda: s.index.match(keys(a)) == 3, heartbeat=False)
        assert s.sub is not None and s.sub.caught_up and s.index.health.replays == 1
        s.publish(removed([b"a3"]))  # and the live stream goes on from there, in sequence
        await s.until(lambda: s.index.match(keys(a)) == 2)
        assert s.index.health.resets == 0 and s.index.health.drops == 0
    finally:
        await s.close()
