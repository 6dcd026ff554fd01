"""An approximate index for replicas that publish no KV events: the blocks of the prompts the proxy
sent there itself, least recently used first out.

It guesses: the replica may have evicted a block sooner (a smaller cache than ``capacity``,
other clients), and knows nothing of a restart. Routing on it can cost a slower path, never a
wrong answer; a replica found down forgets its entries (``forget``): it may come back empty.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from pd_proxy.routing.cache.keys import Key


class ApproxIndex:
    """Per replica, at most ``capacity`` block keys, in order of last use."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.replicas: dict[str, OrderedDict[Key, None]] = {}

    def record(self, replica: str, keys: Sequence[Key]) -> None:
        """``replica`` computed or read these blocks for a request the proxy sent it."""
        blocks = self.replicas.setdefault(replica, OrderedDict())
        for key in keys:
            blocks[key] = None
            blocks.move_to_end(key)
        while len(blocks) > self.capacity:
            blocks.popitem(last=False)

    def match(self, replica: str, keys: Sequence[Key]) -> int:
        blocks = self.replicas.get(replica)
        if not blocks:
            return 0
        n = 0
        for key in keys:
            if key not in blocks:
                break
            n += 1
        return n

    def forget(self, replica: str) -> None:
        self.replicas.pop(replica, None)

    def size(self, replica: str) -> int:
        return len(self.replicas.get(replica, ()))
