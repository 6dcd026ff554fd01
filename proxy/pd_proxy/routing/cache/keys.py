"""The proxy's own key of each block: a chain over token ids, like vLLM's block hash but computed
here, so events and requests meet without agreeing on vLLM's hash algorithm or seed.

Key i covers tokens ``[0, (i + 1) * block_size)``: it hashes key i-1 with block i's token ids (and,
for blocks vLLM hashed with extra keys, those). Python's tuple hash of ints is deterministic
across processes; a collision only costs a worse routing choice, never a wrong answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

Key = int
ROOT: Key = 0x5EED  # the parent of a chain's first block


def chain(
    tokens: Sequence[int], block_size: int, parent: Key = ROOT, extra: Any = None
) -> list[Key]:
    """The keys of the whole blocks of ``tokens`` after ``parent`` (a trailing part has none)."""
    keys: list[Key] = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash((parent, tuple(tokens[start : start + block_size]), extra))
        keys.append(parent)
    return keys


def hit_tokens(blocks: int, block_size: int, prompt_tokens: int) -> int:
    """The prompt tokens a replica holding ``blocks`` leading blocks serves from cache: whole blocks
    only, and at most ``prompt_tokens - 1`` (vLLM always computes the last token)."""
    if prompt_tokens <= 0:
        return 0
    cap = (prompt_tokens - 1) // block_size * block_size
    return min(blocks * block_size, cap)
