"""The proxy's own key of each block: a chain over token ids, like vLLM's block hash but computed
here, so events and requests meet without agreeing on vLLM's hash algorithm or seed.

Key i covers tokens ``[0, (i + 1) * block_size)``: it hashes key i-1 with block i's token ids and
block i's extra keys, as vLLM's ``hash_block_tokens`` does (``kv_cache_utils``). vLLM puts a
request's ``cache_salt`` in the first block's extra keys and a LoRA adapter in every block's, so
a salted or adapter prompt shares no key with the plain one: both sides (pd_proxy.routing.cache
.index from events, pd_proxy.routing.cache.extra from requests) build the same ``Extra`` for a
block. Python's hash of these tuples is stable within one process, which is all the index needs;
a collision only costs a worse routing choice, never a wrong answer.

``chain`` is the C one (``_chain.c``, built with the package) where it was built, else
``python_chain``: the same contract with another hash. Both sides of a process call ``chain``, so
its keys never meet the other's. ``NATIVE`` says which.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Sequence
from typing import Any

Key = int
ROOT: Key = 0x5EED  # the parent of a chain's first block
# Keys keep 60 bits: a 32-byte int in memory, where 64 bits take 48 (pymalloc rounds up).
KEY_MASK = (1 << 60) - 1
# One block's extra keys, tagged by source: ``(("lora", name), ("salt", salt), ("other", ...))``
# in that order, each part only when present; None for a plain block.
Extra = tuple[tuple[Any, ...], ...] | None


def python_chain(
    tokens: Sequence[int],
    block_size: int,
    parent: Key = ROOT,
    extras: Sequence[Extra] | None = None,
) -> list[Key]:
    """The keys of the whole blocks of ``tokens`` after ``parent`` (a trailing part has none);
    ``extras[i]`` is block i's extra keys (None, or a shorter sequence: plain blocks). Key i
    hashes key i-1 with the hash of block i's token ids (and its extra keys, when it has any).
    The blocks' own hashes are taken in C (``map(hash, zip(...))``, no slice copied per
    block), so only the chaining is a Python loop: a third less than slicing each block."""
    keys: list[Key] = []
    append = keys.append
    hashes = map(hash, zip(*[iter(tokens)] * block_size, strict=False))  # a part: no block
    if not extras:
        for h in hashes:
            parent = hash((parent, h)) & KEY_MASK
            append(parent)
        return keys
    n = len(extras)
    for i, h in enumerate(hashes):
        extra = extras[i] if i < n else None
        parent = hash((parent, h) if extra is None else (parent, h, extra)) & KEY_MASK
        append(parent)
    return keys


_native_chain: Callable[[Sequence[int], int, Key, Sequence[Extra] | None], list[Key]] | None
try:
    from pd_proxy.routing.cache._chain import chain as _native_chain
except ImportError:  # no C compiler where the package was built: the Python chain
    _native_chain = None

NATIVE = _native_chain is not None


def chain(
    tokens: Sequence[int],
    block_size: int,
    parent: Key = ROOT,
    extras: Sequence[Extra] | None = None,
) -> list[Key]:
    """``python_chain``'s contract, in C where built (8k tokens: 25 us against 115 us)."""
    if _native_chain is None:
        return python_chain(tokens, block_size, parent, extras)
    return _native_chain(tokens, block_size, parent, extras or None)


def placement_key(tokens: Sequence[int]) -> int:
    """A prompt's first block as an int that is the same in every process and every run (the
    chain's keys hash ``None`` by address on Python 3.11): where a new prefix is placed must not
    depend on which ``--workers`` process routes it."""
    digest = hashlib.blake2b(array("q", tokens).tobytes(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def block_extra(lora: str | None, salt: str | None, other: tuple[Any, ...] = ()) -> Extra:
    """One block's ``Extra`` from its parts (the one spelling both sides use)."""
    parts: list[tuple[Any, ...]] = []
    if lora is not None:
        parts.append(("lora", lora))
    if salt is not None:
        parts.append(("salt", salt))
    if other:
        parts.append(("other", other))
    return tuple(parts) if parts else None


def hit_tokens(blocks: int, block_size: int, prompt_tokens: int) -> int:
    """The prompt tokens a replica holding ``blocks`` leading blocks serves from cache: whole blocks
    only, and at most ``prompt_tokens - 1`` (vLLM always computes the last token)."""
    if prompt_tokens <= 0:
        return 0
    cap = (prompt_tokens - 1) // block_size * block_size
    return min(blocks * block_size, cap)
