"""Run pd-proxy's start-up in this process and print, as JSON, the call chains that re-enter a
pd_proxy module already on the stack (cli -> config -> workers -> cli.run was such a chain).

Used by tests/proxy/test_proxy_startup_path.py in a fresh interpreter: ``python -m
tests.proxy.startup_trace`` starts the proxy on an ephemeral port with two unreachable backends,
returns from the signal wait at once (so the drain path runs too) and reports what it saw.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

PACKAGE = "pd_proxy"


def module_chain(frame: FrameType | None, package: str = PACKAGE) -> list[str]:
    """The modules of ``package`` on the stack below ``frame``, outermost first, with runs of
    the same module collapsed (a module calling its own helpers is one visit)."""
    chain: list[str] = []
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if (name == package or name.startswith(f"{package}.")) and (not chain or chain[-1] != name):
            chain.append(name)
        frame = frame.f_back
    chain.reverse()
    return chain


def trace(run: Callable[[], Any], package: str = PACKAGE) -> tuple[set[str], set[tuple[str, ...]]]:
    """Call ``run`` under a profiler: the package's modules entered, and the re-entrant chains."""
    seen: set[str] = set()
    reentries: set[tuple[str, ...]] = set()

    def profile(frame: FrameType, event: str, _arg: Any) -> None:
        if event != "call":
            return
        chain = module_chain(frame, package)
        if not chain:
            return
        seen.add(chain[-1])
        if len(set(chain)) != len(chain):
            reentries.add(tuple(chain))

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return seen, reentries


def main() -> int:
    from pd_proxy import cli, serve

    async def no_wait() -> None:
        return None

    serve._wait_for_signal = no_wait  # type: ignore[assignment]  # start, then drain at once
    argv = ["--prefill", "http://127.0.0.1:9", "--decode", "http://127.0.0.1:9", "--port", "0"]
    codes: list[int] = []
    seen, reentries = trace(lambda: codes.append(cli.main(argv)))
    print(json.dumps({"rc": codes[0], "seen": sorted(seen), "reentries": sorted(reentries)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
