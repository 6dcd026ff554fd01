"""One index per role (pd_proxy.routing.cache.holders): a prompt's chain walked once gives every
replica's count, the same as each replica's own match; the bound evicts the oldest and counts
them; a block-replica pair costs at most 150 bytes, about 105 with the C part's table. Pure: no
vLLM, no network."""

from __future__ import annotations

import random
import tracemalloc
from collections.abc import Callable

import pytest

from pd_proxy.routing.cache import holders as holders_module
from pd_proxy.routing.cache import table as table_module
from pd_proxy.routing.cache._chain import runs
from pd_proxy.routing.cache.events import Batch, Removed, Stored
from pd_proxy.routing.cache.holders import BlockHolders
from pd_proxy.routing.cache.index import ReplicaIndex
from pd_proxy.routing.cache.keys import chain

BLOCK = 16
# Memory per indexed block-replica pair, mean and peak (just after the index's dicts doubled):
# the kit's bound with the Python table, and what the C part's table (pd-proxy's) achieves.
BYTES_PER_PAIR = {"python": (150, 180), "c": (115, 130)}


def tokens(n_blocks: int, start: int) -> tuple[int, ...]:
    return tuple(range(start, start + n_blocks * BLOCK))


def store(index: ReplicaIndex, seq: int, hashes: list[int], ids: tuple[int, ...]) -> None:
    index.apply(Batch(seq, 0.0, (Stored(tuple(hashes), None, ids, BLOCK, None),), 0))


@pytest.fixture(params=["c", "python"])
def walk_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The walk's lookups in the C part (``runs``, what pd-proxy uses) or in Python."""
    monkeypatch.setattr(holders_module, "_runs", runs if request.param == "c" else None)
    return str(request.param)


def test_one_walk_counts_every_replica_as_its_own_match(walk_path: str) -> None:
    rng = random.Random(5)
    holders = BlockHolders()
    replicas = [ReplicaIndex(holders) for _ in range(6)]
    prompt = tokens(12, 1000)
    for n, index in enumerate(replicas):
        held = 2 * n  # replica n holds the first 2n blocks of the prompt, and other blocks
        store(index, 0, [rng.getrandbits(64) for _ in range(held)], prompt[: held * BLOCK])
        store(index, 1, [rng.getrandbits(64) for _ in range(3)], tokens(3, 50_000 + 100 * n))
    # Replica 5 loses its block 3: its chain breaks there.
    victim = replicas[5].by_hash.oldest(4)[3]
    replicas[5].apply(Batch(2, 0.0, (Removed((victim,)),), 0))
    keys = chain(prompt, BLOCK)
    walk = holders.walk(keys)
    assert [walk[i.slot] for i in replicas] == [i.match(keys) for i in replicas]
    assert [walk[i.slot] for i in replicas] == [0, 2, 4, 6, 8, 3]


def test_the_walk_equals_each_replicas_match_on_random_fleets(walk_path: str) -> None:
    """Random fleets: whole prefixes held by every replica (the walk's fast path), chains
    broken mid-way by a removal, replicas holding nothing, a first block nobody holds."""
    rng = random.Random(11)
    for trial in range(200):
        holders = BlockHolders()
        replicas = [ReplicaIndex(holders) for _ in range(rng.randint(1, 9))]
        prompt = tokens(rng.randint(0, 24), 7 * trial)
        blocks = len(prompt) // BLOCK
        uniform = rng.random() < 0.4
        same = rng.randint(0, blocks)
        for index in replicas:
            held = same if uniform else rng.randint(0, blocks)
            store(index, 0, [rng.getrandbits(64) for _ in range(held)], prompt[: held * BLOCK])
            if held and not uniform and rng.random() < 0.5:
                victim = index.by_hash.oldest(held)[rng.randrange(held)]
                index.apply(Batch(1, 0.0, (Removed((victim,)),), 0))
        keys = chain(prompt, BLOCK)
        walk = holders.walk(keys)
        assert [walk[i.slot] for i in replicas] == [i.match(keys) for i in replicas], trial


def test_the_walk_reads_each_block_once_whatever_the_replicas(
    walk_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """32 replicas holding the same 512 blocks: 512 dict lookups, not 32 x 512 (in C: one
    call of ``runs`` over the 512 keys)."""

    class Counting(dict):
        reads = 0

        def get(self, key, default=None):
            Counting.reads += 1
            return super().get(key, default)

    def counted_runs(held: dict, keys: list) -> list:
        Counting.reads += len(keys)
        return runs(held, keys)

    if walk_path == "c":
        monkeypatch.setattr(holders_module, "_runs", counted_runs)
    holders = BlockHolders()
    prompt = tokens(512, 0)
    replicas = [ReplicaIndex(holders) for _ in range(32)]
    for n, index in enumerate(replicas):
        store(index, 0, [n * 1000 + i for i in range(512)], prompt)
    holders.held = Counting(holders.held)
    walk = holders.walk(chain(prompt, BLOCK))
    assert walk == [512] * 32 and Counting.reads == 512


@pytest.mark.parametrize("of", [runs, holders_module._python_runs], ids=["c", "python"])
def test_runs_are_the_held_values_in_runs_up_to_the_first_missing_key(of: Callable) -> None:
    a, b = 1 << 40, 3
    held = {1: a, 2: a, 3: b, 4: int("3"), 5: a, 7: b}
    assert of(held, [1, 2, 3, 4, 5, 6, 7]) == [(a, 2), (b, 2), (a, 1)]
    assert of(held, [6, 1]) == [] and of(held, []) == []
    assert of(held, [7, 3]) == [(b, 2)]
    with pytest.raises(TypeError):
        of(held, [[1]])  # an unhashable key is an error, not a miss


def test_a_replica_that_goes_takes_its_entries_and_frees_its_slot() -> None:
    holders = BlockHolders()
    a, b = ReplicaIndex(holders), ReplicaIndex(holders)
    prompt = tokens(4, 0)
    store(a, 0, [1, 2, 3, 4], prompt)
    store(b, 0, [11, 12, 13, 14], prompt)
    assert holders.pairs == 8 and len(holders.held) == 4
    a.close()
    assert holders.pairs == 4 and holders.walk(chain(prompt, BLOCK))[b.slot] == 4
    c = ReplicaIndex(holders)
    assert c.slot == a.slot and c.match(chain(prompt, BLOCK)) == 0
    b.restart()
    assert holders.pairs == 0 and holders.held == {}


def test_the_same_block_stored_twice_on_a_replica_is_kept_until_both_go() -> None:
    holders = BlockHolders()
    a = ReplicaIndex(holders)
    prompt = tokens(1, 0)
    store(a, 0, [1], prompt)
    store(a, 1, [2], prompt)  # another vLLM hash, the same tokens: the same proxy key
    keys = chain(prompt, BLOCK)
    a.apply(Batch(2, 0.0, (Removed((1,)),), 0))
    assert a.match(keys) == 1
    a.apply(Batch(3, 0.0, (Removed((2,)),), 0))
    assert a.match(keys) == 0 and holders.pairs == 0


def test_the_bound_evicts_the_oldest_and_counts_them() -> None:
    holders = BlockHolders(capacity=160)
    a, b = ReplicaIndex(holders), ReplicaIndex(holders)
    old = tokens(40, 0)
    store(a, 0, list(range(40)), old)
    store(b, 0, list(range(100, 140)), tokens(40, 10_000))
    for seq in range(1, 6):  # a keeps storing: 180 pairs in all, past the bound
        store(a, seq, list(range(1000 * seq, 1000 * seq + 20)), tokens(20, 100_000 * seq))
    assert holders.pairs <= 160 and holders.evicted == 180 - holders.pairs > 0
    assert a.match(chain(old, BLOCK)) == 0  # its oldest blocks went first
    newest = tokens(20, 500_000)
    assert a.match(chain(newest, BLOCK)) == 20
    assert len(a) + len(b) == holders.pairs


@pytest.mark.parametrize("table", ["c", "python"])
def test_a_block_replica_pair_costs_at_most_150_bytes(
    table: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Measured with tracemalloc over the index's own objects: 8 replicas each storing blocks of
    their own (the worst case: nothing shared), with vLLM's 64-bit int hashes, at sizes across
    one doubling of the index's dicts. A dict just grown is half empty: the peak right after,
    the mean over the cycle is what a large index costs. Each stream's hash table in C (what
    pd-proxy uses) and in Python (the fallback)."""
    if table == "python":
        monkeypatch.setattr(table_module, "_BlockTable", None)
    rng = random.Random(7)
    same = tokens(100, 0)  # every batch after a replica's first: the same tokens, chained on
    events = []
    for n in range(8):
        batches, parent = [], None
        for chunk in range(250):
            ids = tokens(100, 10_000 * (n + 1)) if parent is None else same
            hashes = tuple(rng.getrandbits(64) for _ in range(100))
            batches.append(Batch(chunk, 0.0, (Stored(hashes, parent, ids, BLOCK, None),), 0))
            parent = hashes[-1]
        events.append(batches)
    costs = []
    for chunks in (100, 150, 200, 250):  # 80,000 to 200,000 pairs
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            holders = BlockHolders()
            replicas = [ReplicaIndex(holders) for _ in range(8)]
            for index, batches in zip(replicas, events, strict=True):
                for batch in batches[:chunks]:
                    index.apply(batch)
            used = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        assert holders.pairs == 8 * 100 * chunks
        costs.append(used / holders.pairs)
    assert type(replicas[0].by_hash).__name__ == ("BlockTable" if table == "c" else "DictTable")
    mean = sum(costs) / len(costs)
    shown = ", ".join(f"{c:.0f}" for c in costs)
    bound, peak = BYTES_PER_PAIR[table]
    assert mean <= bound, f"{mean:.0f} bytes per pair on average ({shown})"
    assert max(costs) <= peak, f"bytes per pair: {shown}"
