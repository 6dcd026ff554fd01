"""One event stream's table of vLLM block hash -> the proxy's key, in order of storing
(``ReplicaIndex.by_hash``): what a ``BlockRemoved``, which names only vLLM's hashes, needs to find
a block's key, and what the index's bound evicts from the front.

``new_table`` makes the C part's ``BlockTable`` (``_block_table.c``: 16 bytes an entry plus its
index slot) where it was built, else a ``DictTable``: in a dict, an entry and its hash's int
object took about 73 bytes, half of an indexed block-replica pair. Both hold ints below 2**64
(60-bit hashes and keys). ``NATIVE`` says which is in use.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from itertools import islice
from typing import Protocol, overload

from pd_proxy.routing.cache.keys import Key


class Table(Protocol):
    """What the index and its bound call on a table (a dict's methods, plus ``oldest``)."""

    def __len__(self) -> int: ...
    def __contains__(self, h: object, /) -> bool: ...
    def __setitem__(self, h: int, key: Key, /) -> None: ...
    def get(self, h: int, /) -> Key | None: ...
    @overload
    def pop(self, h: int, /) -> Key: ...
    @overload
    def pop(self, h: int, default: None, /) -> Key | None: ...
    def values(self) -> Iterable[Key]: ...
    def clear(self) -> None: ...
    def oldest(self, n: int, /) -> list[int]: ...


class DictTable(dict[int, Key]):
    """The Python fallback: a dict keeps the order of storing."""

    def oldest(self, n: int, /) -> list[int]:
        """The first ``n`` hashes, oldest first."""
        return list(islice(self, n))


_BlockTable: Callable[[], Table] | None
try:
    from pd_proxy.routing.cache._chain import BlockTable as _BlockTable
except ImportError:  # no C compiler where the package was built
    _BlockTable = None

NATIVE = _BlockTable is not None


def new_table() -> Table:
    return DictTable() if _BlockTable is None else _BlockTable()
