"""The KV-event index and its pure neighbours, fed with messages vLLM 0.32's own classes encode."""

from __future__ import annotations

import functools
import random

import msgpack
import pytest

from pd_proxy.routing.cache.approx import ApproxIndex
from pd_proxy.routing.cache.events import BadBatch, Cleared, Removed, Stored, decode
from pd_proxy.routing.cache.index import GAP, NEXT, RESET, ReplicaIndex
from pd_proxy.routing.cache.keys import KEY_MASK, ROOT, chain, hit_tokens, python_chain
from pd_proxy.routing.cache.pending import PendingIndex
from pd_proxy.routing.decider import decide

from .vllm_events import BLOCK, blocks, cleared, frames, removed, stored

pytestmark = pytest.mark.vllm  # the events are encoded by vLLM's own classes


def feed(index: ReplicaIndex, seq: int, *events) -> str:
    batch = decode(frames(seq, *events))
    verdict = index.accept(batch.seq)
    if verdict == RESET:
        index.restart()
    index.apply(batch)
    return verdict


def test_vllm_batches_decode_to_records() -> None:
    tokens = blocks(2)
    batch = decode(
        frames(7, stored([b"h1", b"h2"], None, tokens), removed([b"h1"]), cleared(), topic=b"")
    )
    assert batch.seq == 7 and batch.ts == 1.0 and batch.dp_rank == 0
    first, second, third = batch.events
    assert isinstance(first, Stored) and first.block_hashes == (b"h1", b"h2")
    assert first.token_ids == tuple(tokens) and first.block_size == BLOCK and first.extras is None
    assert isinstance(second, Removed) and second.block_hashes == (b"h1",)
    assert isinstance(third, Cleared)


def test_int_hashes_and_other_tiers_and_groups() -> None:
    batch = decode(
        frames(
            0,
            stored([11], None, blocks(1)),
            stored([12], None, blocks(1), medium="CPU"),  # an offload tier: not a device hit
            stored([13], None, blocks(1), group_idx=1),  # a second KV cache group
        )
    )
    assert [e.block_hashes for e in batch.events if isinstance(e, Stored)] == [(11,)]


@pytest.mark.parametrize(
    "payload",
    [
        msgpack.packb([1.0, [["BlockStored", [1], None, [1, 2, 3, 4], 4, None, "GPU"]], 0]),
        msgpack.packb({"ts": 1.0}),
        b"\xc1not msgpack",
        msgpack.packb([1.0, [{"type": "Mystery", "block_hashes": [1]}], 0]),
        msgpack.packb(
            [
                1.0,
                [
                    {
                        "type": "BlockStored",
                        "block_hashes": [1, 2],
                        "token_ids": [1],
                        "block_size": 4,
                    }
                ],
            ]
        ),
    ],
    ids=["positional-pre-0.32", "not-a-batch", "garbage", "unknown-type", "tokens-mismatch"],
)
def test_batches_in_another_shape_are_refused(payload: bytes) -> None:
    with pytest.raises(BadBatch):
        decode([b"kv", (0).to_bytes(8, "big"), payload])


def test_store_match_remove_with_own_keys() -> None:
    index = ReplicaIndex()
    prompt = blocks(3)
    assert feed(index, 0, stored([b"a", b"b"], None, prompt[: 2 * BLOCK])) == NEXT
    assert feed(index, 1, stored([b"c"], b"b", prompt[2 * BLOCK :])) == NEXT
    keys = chain(prompt + [1, 2], BLOCK)  # a trailing part block has no key
    assert len(keys) == 3 and index.match(keys) == 3
    assert index.match(chain(prompt[:BLOCK] + [0] * BLOCK, BLOCK)) == 1  # diverges in block 2
    feed(index, 2, removed([b"b"]))  # vLLM evicts the middle block: the chain breaks there
    assert index.match(keys) == 1
    feed(index, 3, cleared())
    assert index.match(keys) == 0 and len(index) == 0


def test_stored_events_confirm_what_was_pending_there() -> None:
    """The router's pending entries go when the replica's events announce the blocks (per
    event, not per request), and only there."""
    pending = PendingIndex()
    index = ReplicaIndex(on_stored=functools.partial(pending.confirm, "a"))
    prompt = blocks(3)
    keys = chain(prompt, BLOCK)
    pending.record("a", keys, now=0.0)
    pending.record("b", keys, now=0.0)
    feed(index, 0, stored([b"a", b"b"], None, prompt[: 2 * BLOCK]))
    assert list(pending.replicas["a"]) == keys[2:] and list(pending.replicas["b"]) == keys
    feed(index, 1, stored([b"c"], b"b", prompt[2 * BLOCK :]))
    assert "a" not in pending.replicas and pending.match("b", keys, now=1.0) == 3


def test_a_chain_key_is_its_parent_and_its_block_whatever_the_lengths() -> None:
    """The Python ``chain`` (pd-proxy's fallback where its C one is not built) against its
    definition, block by block: key i hashes key i-1 with the hash of
    block i's token ids (and block i's extra keys, when it has any); a trailing part has no key;
    a chain split anywhere on a block boundary and continued from its last key gives the same
    keys (as events do)."""
    rng = random.Random(3)
    for _ in range(100):
        size = rng.choice([1, 2, 16, 17])
        ids = [rng.randrange(50_000) for _ in range(rng.randint(0, 5 * size + 3))]
        blocks = len(ids) // size
        extras = [rng.choice([None, (("salt", "s"),), (("lora", "a"),)]) for _ in range(blocks)]
        extras = extras[: rng.randint(0, blocks)]  # shorter: the rest plain
        expected, parent = [], ROOT
        for i in range(blocks):
            extra = extras[i] if i < len(extras) else None
            block = hash(tuple(ids[i * size : (i + 1) * size]))
            parent = hash((parent, block) if extra is None else (parent, block, extra)) & KEY_MASK
            expected.append(parent)
        assert python_chain(ids, size, extras=extras or None) == expected
        cut = rng.randint(0, blocks)
        head = python_chain(ids[: cut * size], size, extras=extras[:cut] or None)
        tail = python_chain(
            ids[cut * size :], size, head[-1] if head else ROOT, extras[cut:] or None
        )
        assert head + tail == expected


def test_vllm_hash_values_do_not_matter_only_tokens_do() -> None:
    """Two replicas with different hash seeds store the same prompt: both match it."""
    prompt = blocks(2)
    a, b = ReplicaIndex(), ReplicaIndex()
    feed(a, 0, stored([b"seed1-x", b"seed1-y"], None, prompt))
    feed(b, 0, stored([901, 902], None, prompt))
    keys = chain(prompt, BLOCK)
    assert a.match(keys) == b.match(keys) == 2


def test_orphan_blocks_are_skipped_never_guessed() -> None:
    index = ReplicaIndex()
    feed(index, 0, stored([b"c"], b"unknown-parent", blocks(1, start=500)))
    assert len(index) == 0 and index.health.orphans == 1


def test_blocks_with_extra_keys_never_match_a_plain_prompt() -> None:
    index = ReplicaIndex()
    prompt = blocks(1)
    feed(index, 0, stored([b"s"], None, prompt, extra_keys=[("salt",)]))
    feed(index, 1, stored([b"l"], None, prompt, lora_name="adapter", lora_id=1))
    assert len(index) == 2 and index.match(chain(prompt, BLOCK)) == 0


def test_sequence_gap_and_restart_verdicts() -> None:
    index = ReplicaIndex()
    prompt = blocks(1)
    assert feed(index, 5, stored([b"a"], None, prompt)) == NEXT  # the first one seen
    assert index.accept(6) == NEXT
    assert index.accept(9) == GAP
    index.drop(9)  # nothing filled the gap: every entry goes, the stream goes on at 9
    assert len(index) == 0 and index.health.drops == 1 and index.accept(9) == NEXT
    feed(index, 9, stored([b"a"], None, prompt))
    assert index.match(chain(prompt, BLOCK)) == 1
    assert feed(index, 0, stored([b"z"], None, blocks(1, start=900))) == RESET
    assert index.match(chain(prompt, BLOCK)) == 0 and index.health.resets == 1


def test_hit_tokens_whole_blocks_capped_below_the_prompt() -> None:
    assert hit_tokens(3, 16, 100) == 48
    assert hit_tokens(4, 16, 64) == 48  # an exact multiple: the last block is computed again
    assert hit_tokens(0, 16, 64) == 0
    assert hit_tokens(5, 16, 0) == 0


def test_approx_index_lru() -> None:
    approx = ApproxIndex(capacity=3)
    a, b = chain(blocks(2), BLOCK), chain(blocks(2, start=700), BLOCK)
    approx.record("r1", a)
    assert approx.match("r1", a) == 2 and approx.match("r2", a) == 0
    approx.record("r1", b)  # 4 keys into 3 slots: a's first block, least recent, goes
    assert approx.match("r1", b) == 2 and approx.match("r1", a) == 0
    approx.forget("r1")
    assert approx.match("r1", b) == 0


@pytest.mark.parametrize(
    ("prompt", "cached", "limit", "expected"),
    [
        (40, 0, 64, ("local", "short")),
        (1400, 1392, 64, ("local", "cached")),  # a follow-up turn whose history decode holds
        (1400, 1200, 64, ("pd", "long")),
        (1400, 0, 64, ("pd", "long")),  # nothing cached: today's count
        (None, 0, 64, ("pd", "no_tokens")),
        (40, 0, 0, ("pd", "long")),  # 0: every request P/D
    ],
)
def test_decide_on_uncached_tokens(prompt, cached, limit, expected) -> None:
    assert decide(prompt, cached, limit) == expected
