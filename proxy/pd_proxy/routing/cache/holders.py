"""One role's blocks: each block key and the replicas holding it, so a prompt's chain is walked
once for every replica of the role (``walk``), not once per replica.

Each event stream (an engine behind a replica's API server, pd_proxy.routing.cache.index) takes a
slot; a block's holders are a bit mask of slots. A block held by one slot shares the slot's bit
object, so the mask costs nothing beside the dict entry. The same key stored under a second vLLM
hash on one slot is counted apart (``dups``, rare), so removing one copy keeps the other.

``capacity`` bounds the block-replica pairs: past it, each slot loses its oldest stored blocks in
proportion to what it holds, down to 15/16 of the bound (a batch, so the dicts' fronts are
scanned once per batch). A block evicted can only be under-counted: its replica still holds it.
Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import groupby
from typing import Protocol, cast

from pd_proxy.routing.cache.keys import Key
from pd_proxy.routing.cache.table import Table

_runs: Callable[[dict[Key, int], Sequence[Key]], list[tuple[int, int]]] | None
try:  # the walk's lookups in C where pd-proxy's C part is built (_chain.c), else ``map``
    from pd_proxy.routing.cache._chain import runs as _runs
except ImportError:
    _runs = None


class Stream(Protocol):
    """What the bound needs of a slot's stream: its entries in order of storing."""

    by_hash: Table


class BlockHolders:
    def __init__(self, capacity: int | None = None) -> None:
        self.capacity = capacity
        self.held: dict[Key, int] = {}  # key -> bit mask of the slots holding it
        self.streams: list[Stream | None] = []  # slot -> its stream (None: free)
        self.bits: list[int] = []  # slot -> 1 << slot, one object per slot
        self.dups: dict[tuple[int, Key], int] = {}  # (slot, key) -> extra copies
        self.pairs = 0  # block-replica pairs held
        self.evicted = 0  # pairs dropped by the bound, ever
        # LoRA adapters any of its streams named in stored blocks, ever: the router asks of every
        # request's model, where a look at each replica's own set cost 64 set lookups at 32.
        self.adapters: set[str] = set()

    def join(self, stream: Stream) -> int:
        """A slot for ``stream`` (a freed one first)."""
        for slot, taken in enumerate(self.streams):
            if taken is None:
                self.streams[slot] = stream
                return slot
        self.streams.append(stream)
        self.bits.append(1 << (len(self.streams) - 1))
        return len(self.streams) - 1

    def leave(self, slot: int) -> None:
        """The slot's stream is gone: its entries must have been discarded (``clear``)."""
        self.streams[slot] = None

    def add(self, slot: int, key: Key) -> None:
        bit = self.bits[slot]
        mask = self.held.get(key)
        if mask is None:
            self.held[key] = bit
            self.pairs += 1
        elif mask & bit:
            self.dups[slot, key] = self.dups.get((slot, key), 0) + 1
        else:
            self.held[key] = mask | bit
            self.pairs += 1

    def discard(self, slot: int, key: Key) -> None:
        if self.dups:
            extra = self.dups.get((slot, key))
            if extra is not None:
                if extra > 1:
                    self.dups[slot, key] = extra - 1
                else:
                    del self.dups[slot, key]
                return
        mask = self.held.get(key)
        bit = self.bits[slot]
        if mask is None or not mask & bit:
            return
        self.pairs -= 1
        mask ^= bit
        if not mask:
            del self.held[key]
        elif mask & (mask - 1):
            self.held[key] = mask
        else:
            self.held[key] = self.bits[mask.bit_length() - 1]  # one holder: its shared bit

    def drop_slot(self, slot: int, keys: Sequence[Key]) -> None:
        """Discard every key of a slot's entries (its stream cleared)."""
        for key in keys:
            self.discard(slot, key)
        if self.dups:
            for pair in [p for p in self.dups if p[0] == slot]:
                del self.dups[pair]

    def holds(self, slot: int, keys: Sequence[Key]) -> int:
        """How many of ``keys`` lead what ``slot`` holds."""
        bit = self.bits[slot]
        held = self.held
        n = 0
        for key in keys:
            if not held.get(key, 0) & bit:
                break
            n += 1
        return n

    def walk(self, keys: Sequence[Key]) -> list[int]:
        """Per slot, how many of ``keys`` lead what it holds: one pass over the chain, each
        slot's count settled when the chain leaves it. The masks come in runs of blocks held
        by the same slots (the C part's ``runs``, else ``_python_runs``): the common case, a
        prefix every holder holds whole, is one run."""
        runs = (_runs or _python_runs)(self.held, keys)
        out = [0] * len(self.streams)
        if not runs:
            return out
        alive, n = runs[0]
        for mask, length in runs[1:]:
            ended = alive & ~mask
            if ended:
                _settle(out, ended, n)
                alive &= mask
                if not alive:
                    return out
            n += length
        _settle(out, alive, n)
        return out

    def over(self) -> bool:
        return self.capacity is not None and self.pairs > self.capacity

    def bound(self) -> int:
        """Evict the oldest stored blocks past ``capacity``; the pairs dropped."""
        if self.capacity is None or self.pairs <= self.capacity:
            return 0
        target = self.capacity - self.capacity // 16
        need = self.pairs - target
        total = self.pairs
        dropped = 0
        for slot, stream in enumerate(self.streams):
            if stream is None or not stream.by_hash:
                continue
            share = -(-need * len(stream.by_hash) // total)  # rounded up: at least one
            entries = stream.by_hash
            for h in entries.oldest(share):
                before = self.pairs
                self.discard(slot, entries.pop(h))
                dropped += before - self.pairs
        self.evicted += dropped
        return dropped


def _python_runs(held: dict[Key, int], keys: Sequence[Key]) -> list[tuple[int, int]]:
    """The C part's ``runs`` in Python: the masks of the leading held keys, as (mask, length)
    runs of equal ones."""
    found = list(map(held.get, keys))
    try:
        found = found[: found.index(None)]
    except ValueError:
        pass
    return [(mask, sum(1 for _ in run)) for mask, run in groupby(cast(list[int], found))]


def _settle(out: list[int], mask: int, n: int) -> None:
    while mask:
        low = mask & -mask
        out[low.bit_length() - 1] = n
        mask ^= low
