"""What one replica's prefix cache holds, as told by its KV events, keyed by the proxy's own keys.

"Dual key": each stored block is indexed by the proxy's key (pd_proxy.routing.cache.keys) and
remembered
by vLLM's hash, so a ``BlockRemoved`` (which carries only vLLM hashes) can find it. A stored block
whose parent the index does not hold is skipped: the index may under-count a replica's cache
(a P/D request it could have served alone) but never over-counts it from a broken chain.

Sequence numbers decide what the index may trust (``ReplicaIndex.accept``):
- the next number: apply;
- a jump ahead: a gap, some batches were lost; the caller replays them or ``drop``s the replica's
  entries (removals may be among the lost ones, and a stale entry routes a request wrongly);
- a number behind: the publisher restarted (its count starts again at 0): clear, then apply.
A proxy that starts late treats its first batch as NEXT after asking for a replay from 0.
Pure: no I/O, no clock (the caller passes times).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from pd_proxy.routing.cache.events import Batch, BlockHash, Cleared, Event, Removed, Stored
from pd_proxy.routing.cache.keys import ROOT, Key, chain

NEXT, GAP, RESET = "next", "gap", "reset"
COUNTERS = ("batches", "events", "gaps", "replays", "drops", "resets", "orphans")


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
    """One replica's blocks. ``expected`` is the next sequence number (None before the first)."""

    def __init__(self) -> None:
        self.refs: dict[Key, int] = {}
        self.by_hash: dict[BlockHash, Key] = {}
        self.block_size: int | None = None
        # LoRA adapters named in its stored blocks: a request whose model is one is keyed as it.
        self.adapters: set[str] = set()
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
        self.refs.clear()
        self.by_hash.clear()

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
            known = self.by_hash.get(ev.parent)
            if known is None:
                self.health.orphans += len(ev.block_hashes)
                return
            parent = known
        self.block_size = ev.block_size
        if ev.extras is not None:
            self.adapters.update(
                part[1] for extra in ev.extras if extra for part in extra if part[0] == "lora"
            )
        keys = chain(ev.token_ids, ev.block_size, parent, ev.extras)
        for h, key in zip(ev.block_hashes, keys, strict=True):
            if h in self.by_hash:
                continue  # stored again (e.g. received over NIXL after a local copy): one entry
            self.by_hash[h] = key
            self.refs[key] = self.refs.get(key, 0) + 1

    def _remove(self, h: BlockHash) -> None:
        key = self.by_hash.pop(h, None)
        if key is None:
            return
        left = self.refs[key] - 1
        if left:
            self.refs[key] = left
        else:
            del self.refs[key]

    def match(self, keys: Sequence[Key]) -> int:
        """How many of ``keys`` (a request's chain, same block size) lead the replica's cache."""
        refs = self.refs
        n = 0
        for key in keys:
            if key not in refs:
                break
            n += 1
        return n
