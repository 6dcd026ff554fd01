"""What one replica's prefix cache holds, as told by its KV events, keyed by the proxy's own keys.

"Dual key": each stored block is indexed by the proxy's key (pd_proxy.routing.cache.keys), in the
role's ``BlockHolders`` (pd_proxy.routing.cache.holders) the router walks once per prompt, and
remembered by vLLM's hash, so a ``BlockRemoved`` (which carries only vLLM hashes) can find it. A
stored block whose parent the index does not hold is skipped: the index may under-count a
replica's cache (a P/D request it could have served alone) but never over-counts it from a
broken chain.

Sequence numbers decide what the index may trust (``ReplicaIndex.accept``):
- the next number: apply;
- a jump ahead: a gap, some batches were lost; the caller replays them or ``drop``s the replica's
  entries (removals may be among the lost ones, and a stale entry routes a request wrongly);
- a number behind: the publisher restarted (its count starts again at 0): clear, then apply.
A proxy that starts late treats its first batch as NEXT after asking for a replay from 0.
Pure: no I/O, no clock (the caller passes times).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from pd_proxy.routing.cache.events import Batch, BlockHash, Cleared, Event, Removed, Stored
from pd_proxy.routing.cache.holders import BlockHolders
from pd_proxy.routing.cache.keys import ROOT, Key, chain
from pd_proxy.routing.cache.table import new_table

NEXT, GAP, RESET = "next", "gap", "reset"
COUNTERS = ("batches", "events", "gaps", "replays", "drops", "resets", "orphans")
SHORT_MASK = (1 << 60) - 1


@dataclass
class Health:
    """Counters of one replica's event stream (pd_proxy.routing.cache.metrics exports them)."""

    batches: int = 0
    events: int = 0
    gaps: int = 0
    replays: int = 0
    drops: int = 0  # gaps no replay could fill: the entries were dropped
    resets: int = 0  # sequence went back: the publisher restarted
    orphans: int = 0  # stored blocks whose parent was unknown (skipped)
    last_ts: float | None = None  # the newest batch's publisher timestamp

    @classmethod
    def total(cls, healths: Iterable[Health]) -> Health:
        """The counters of several streams (the DP engines behind one API server) added up."""
        out = cls()
        for h in healths:
            for name in COUNTERS:
                setattr(out, name, getattr(out, name) + getattr(h, name))
        return out


class ReplicaIndex:
    """One event stream's blocks. ``expected`` is the next sequence number (None before the
    first). Its entries live in ``holders``, the role's index it shares with the other streams
    (its own when none is given: a replica indexed alone). Slots: the router reads four of its
    attributes for each replica of a role on every request."""

    __slots__ = (
        "holders",
        "on_stored",
        "by_hash",
        "slot",
        "block_size",
        "expected",
        "health",
    )

    def __init__(
        self,
        holders: BlockHolders | None = None,
        on_stored: Callable[[list[Key]], None] | None = None,
    ) -> None:
        self.holders = BlockHolders() if holders is None else holders
        # Told the keys each Stored event added (the router's pending entries for them go).
        self.on_stored = on_stored
        # vLLM's hash (60 bits of it) -> the proxy's key, in order of storing (the bound evicts
        # from the front): in C where built (pd_proxy.routing.cache.table).
        self.by_hash = new_table()
        self.slot = self.holders.join(self)
        self.block_size: int | None = None
        self.expected: int | None = None
        self.health = Health()

    def __len__(self) -> int:
        return len(self.by_hash)

    def accept(self, seq: int) -> str:
        """How a live batch numbered ``seq`` relates to the stream: NEXT, GAP or RESET (a number
        behind: only a restarted publisher counts again; the first batches after its restart may
        be lost too, which can only under-count)."""
        if self.expected is None or seq == self.expected:
            return NEXT
        return GAP if seq > self.expected else RESET

    def apply(self, batch: Batch) -> None:
        """Apply a batch the caller accepted (after a RESET, call ``restart`` first)."""
        for ev in batch.events:
            self.apply_event(ev)
        self.expected = batch.seq + 1
        h = self.health
        h.batches += 1
        h.events += len(batch.events)
        h.last_ts = batch.ts
        if self.holders.over():
            self.holders.bound()

    def restart(self) -> None:
        """The publisher started again: what it held is gone; its stream starts anew."""
        self.health.resets += 1
        self.clear()
        self.expected = None

    def drop(self, resume_at: int | None) -> None:
        """A gap nothing filled: forget every entry; the stream goes on from ``resume_at``."""
        self.health.drops += 1
        self.clear()
        self.expected = resume_at

    def clear(self) -> None:
        self.holders.drop_slot(self.slot, list(self.by_hash.values()))
        self.by_hash.clear()

    def close(self) -> None:
        """The stream is no longer followed: its entries and slot go."""
        self.clear()
        self.holders.leave(self.slot)

    def apply_event(self, ev: Event) -> None:
        if isinstance(ev, Stored):
            self._store(ev)
        elif isinstance(ev, Removed):
            for h in ev.block_hashes:
                self._remove(h)
        elif isinstance(ev, Cleared):
            self.clear()

    def _store(self, ev: Stored) -> None:
        if ev.parent is None:
            parent = ROOT
        else:
            known = self.by_hash.get(short_hash(ev.parent))
            if known is None:
                self.health.orphans += len(ev.block_hashes)
                return
            parent = known
        self.block_size = ev.block_size
        if ev.extras is not None:
            named = {part[1] for extra in ev.extras if extra for part in extra if part[0] == "lora"}
            if named:  # a request whose model is one is keyed as it (the role's set)
                self.holders.adapters |= named
        keys = chain(ev.token_ids, ev.block_size, parent, ev.extras)
        by_hash, holders, slot = self.by_hash, self.holders, self.slot
        for h, key in zip(ev.block_hashes, keys, strict=True):
            h = short_hash(h)
            if h in by_hash:
                continue  # stored again (e.g. received over NIXL after a local copy): one entry
            by_hash[h] = key
            holders.add(slot, key)
        if self.on_stored is not None and keys:
            self.on_stored(keys)

    def _remove(self, h: BlockHash) -> None:
        key = self.by_hash.pop(short_hash(h), None)
        if key is not None:
            self.holders.discard(self.slot, key)

    def match(self, keys: Sequence[Key]) -> int:
        """How many of ``keys`` (a request's chain, same block size) lead the replica's cache."""
        return self.holders.holds(self.slot, keys)


def short_hash(h: BlockHash) -> int:
    """60 bits of a vLLM block hash: a 32-byte int in memory where the whole 64 bits take 48
    (a collision can only under-count: the second block is taken for the first)."""
    if isinstance(h, bytes):
        h = int.from_bytes(h[-8:], "big")
    return h & SHORT_MASK
