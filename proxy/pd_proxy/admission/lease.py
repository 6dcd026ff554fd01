"""What an admitted request holds, and how it gives it back: its ``Lease``.

A lease holds the request's prefill room until its prefill leg has answered, its decode room until
it ends, and a pending pull on its decode between the two. The legs and the relay report those
moments (through the request's ``Trace``, pd_proxy.tracing); each part goes back once, whatever
happens.

Room given back wakes the admit stage's queue (``Wakeup``) from the event loop, once however many
leases gave back in between, never on the stack of the request that gave it back: a relay's first
byte does not run other requests' admission, and the request's walk never comes back into the
gate (pd_proxy.admission.gate) after it was admitted.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from pd_proxy.admission.fair_queue import FairQueue
from pd_proxy.admission.rate import Rate
from pd_proxy.admission.room import Room


class Wakeup:
    """Run the gate's ``dispatch`` soon when room came back and someone waits for it."""

    __slots__ = ("_queue", "_dispatch", "_due")

    def __init__(self, queue: FairQueue, dispatch: Callable[[], None]) -> None:
        self._queue = queue
        self._dispatch = dispatch
        self._due = False

    def __call__(self) -> None:
        if self._due or not len(self._queue):
            return
        self._due = True
        asyncio.get_running_loop().call_soon(self._run)

    def _run(self) -> None:
        self._due = False
        self._dispatch()


class Lease:
    """The room one admitted request holds; each part is given back once."""

    __slots__ = (
        "_room",
        "_rate",
        "_clock",
        "_wake",
        "_prefill",
        "_decode",
        "_tokens",
        "_pull",
        "_timed",
        "_done",
    )

    def __init__(
        self,
        room: Room,
        rate: Rate,
        *,
        clock: Callable[[], float],
        wake: Callable[[], None],
        prefill: str | None,
        decode: str,
        tokens: int,
        pd: bool,
    ) -> None:
        self._room = room
        self._rate = rate
        self._clock = clock
        self._wake = wake
        self._prefill = prefill
        self._decode = decode
        self._tokens = tokens
        # A P/D request's KV will wait on its prefill for this decode's pull: counted from
        # admission, so a decode that cannot keep up stops new prefill legs for it.
        self._pull = pd
        # Its prompt's computation is timed for the rate: until the prefill leg answers (P/D),
        # or the decode's first byte (decode alone).
        self._timed = True
        rate.begin(clock())
        self._done = False

    def prefill_done(self) -> None:
        """The prefill leg answered: its room goes back; the KV now waits for the decode."""
        if self._prefill is None or self._done:
            return
        url, self._prefill = self._prefill, None
        self._room.give_prefill(url, self._tokens)
        self._stop_timing(self._tokens)
        self._wake()

    def decode_started(self) -> None:
        """The decode answered its first byte: the KV was pulled (or the prompt computed there,
        which is the work a decode-alone request's rate counts)."""
        if self._done:
            return
        if self._pull:
            self._pull = False
            self._room.of(self._decode).pulls -= 1
        elif self._timed:
            self._stop_timing(self._tokens)
        else:
            return
        self._wake()

    def release(self) -> None:
        """The request ended, however: everything it still holds goes back."""
        if self._done:
            return
        if self._prefill is not None:
            self._room.give_prefill(self._prefill, self._tokens)
            self._prefill = None
        self._stop_timing(None)
        self._done = True
        use = self._room.of(self._decode)
        use.requests -= 1
        if self._pull:
            use.pulls -= 1
            self._pull = False
        self._wake()

    def _stop_timing(self, tokens: int | None) -> None:
        if self._timed:
            self._timed = False
            self._rate.end(self._clock(), tokens)
