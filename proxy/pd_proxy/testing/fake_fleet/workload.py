"""What the fake fleet's publishers send, packed ahead (pd_proxy.testing.kv_publisher): a
replica's steady churn and the blocks that fill an index. Pure.

Each replica's blocks are its own (distinct tokens, distinct hashes): the worst case for an index
that shares an entry among the replicas holding a block, and what a per-replica index always has.
"""

from __future__ import annotations

from pd_proxy.testing.kv_publisher import block_hash, removed, stored

CHAINS, CHAIN_BLOCKS, LIVE = 32, 32, 16  # the churn: 32 chains of 32 blocks, 16 held at a time


def chain_tokens(replica: int, chain: int, blocks: int, size: int) -> list[int]:
    """Token ids of one chain of a replica: its first block names the replica and the chain."""
    first = [replica, chain] + [0] * (size - 2)
    return first + [j & 0x7F for j in range(size, blocks * size)]


def churn_ring(replica: int, size: int, chains: int = CHAINS, chain_blocks: int = CHAIN_BLOCKS,
               live: int = LIVE) -> list[bytes]:  # fmt: skip
    """A replica's churn, one block per event as a decode's steps store and evict them: chain c
    stored block by block, then the chain stored ``live`` chains earlier evicted block by block,
    its last block first. Sent round and round, the replica holds about ``live`` chains."""
    stores: list[list[bytes]] = []
    removes: list[list[bytes]] = []
    for c in range(chains):
        tokens = chain_tokens(replica, c, chain_blocks, size)
        parent: int | None = None
        events, hashes = [], []
        for j in range(chain_blocks):
            block = tokens[j * size : (j + 1) * size]
            h = block_hash(parent, block)
            events.append(stored([h], parent, block, size))
            hashes.append(h)
            parent = h
        stores.append(events)
        removes.append([removed(h) for h in reversed(hashes)])
    ring: list[bytes] = []
    for c in range(chains):
        ring += stores[c] + removes[(c - live) % chains]
    return ring


def take(ring: list[bytes], position: int, count: int) -> tuple[list[bytes], int]:
    """``count`` events of ``ring`` from ``position`` on, wrapping, and the next position."""
    out: list[bytes] = []
    while len(out) < count:
        piece = ring[position : position + count - len(out)]
        out += piece
        position = (position + len(piece)) % len(ring)
    return out, position


def fill_events(replica: int, first_chain: int, blocks: int, size: int, *, per_event: int = 64,
                chain_blocks: int = 1024) -> list[bytes]:  # fmt: skip
    """``BlockStored`` events of ``blocks`` new blocks for a replica, ``per_event`` each (a
    prefill's steps), in chains of ``chain_blocks`` from ``first_chain`` on. Hashes are counters,
    unique per replica, chain and block."""
    out: list[bytes] = []
    done = 0
    chain = first_chain
    while done < blocks:
        length = min(chain_blocks, blocks - done)
        tokens = chain_tokens(replica, chain, length, size)
        parent: int | None = None
        for first in range(0, length, per_event):
            last = min(first + per_event, length)
            hashes = [(replica << 48) | (chain << 16) | j for j in range(first, last)]
            out.append(stored(hashes, parent, tokens[first * size : last * size], size))
            parent = hashes[-1]
        done += length
        chain += 1
    return out
