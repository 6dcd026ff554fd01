# Types of pd-proxy's C part (_chain.c): its block-key chain and the role index's runs of masks.
from collections.abc import Iterable, Sequence
from typing import Any, TypeVar

V = TypeVar("V")

def chain(
    tokens: Iterable[int], block_size: int, parent: int, extras: Sequence[Any] | None = None, /
) -> list[int]: ...
def runs(held: dict[Any, V], keys: Iterable[Any], /) -> list[tuple[V, int]]: ...
