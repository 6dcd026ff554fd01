"""The KV events' share of the event loop (pd_proxy.routing.cache.loop_share): every subscription
draws on one slice, so between two turns of anything else the loop runs about one slice of event
work, however many subscriptions are flooding. A fake clock: each batch "takes" 0.6 of a 1.0
slice."""

from __future__ import annotations

import asyncio

from pd_proxy.routing.cache.loop_share import LoopShare


async def interleaving(share: LoopShare, batches: int = 6) -> list[str]:
    """Four subscriptions flooding, each handling ``batches`` batches, beside a relay taking a
    turn whenever the loop lets it; the order things ran in."""
    now = [0.0]
    share.clock = lambda: now[0]
    order: list[str] = []
    done = asyncio.Event()

    async def subscription(name: str, share: LoopShare) -> None:
        for _ in range(batches):
            await share.turn()
            order.append(name)
            now[0] += 0.6  # the batch's work

    async def relay() -> None:
        while not done.is_set():
            order.append("relay")
            await asyncio.sleep(0)

    watcher = asyncio.create_task(relay())
    subs = [subscription(f"s{i}", share) for i in range(4)]
    await asyncio.gather(*subs)
    done.set()
    await watcher
    return order


def longest_wait(order: list[str]) -> int:
    """The most batches handled between two turns of the relay."""
    most = run = 0
    for name in order:
        run = 0 if name == "relay" else run + 1
        most = max(most, run)
    return most


async def test_one_share_lets_the_relay_in_after_about_one_slice_whatever_the_subscriptions():
    order = await interleaving(LoopShare(seconds=1.0))
    assert order.count("s0") == order.count("s3") == 6  # every batch handled
    assert longest_wait(order) <= 2  # a slice of 1.0: the batch that crosses it, and one before
    work = [name for name in order if name != "relay"]
    assert set(work[:8]) == {"s0", "s1", "s2", "s3"}  # in turn: a flood starves no one


async def test_a_waiting_subscription_cancelled_leaves_the_others_waiting_for_the_pass():
    share = LoopShare(seconds=1.0, clock=lambda: 5.0)  # the slice has run out
    first = asyncio.create_task(share.turn())
    second = asyncio.create_task(share.turn())
    await asyncio.sleep(0)
    first.cancel()
    await asyncio.wait_for(second, timeout=1.0)  # the pass came: it goes on
    assert first.cancelled() and share.ends == 6.0
