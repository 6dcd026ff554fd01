"""One completion's walk through pd-proxy, from the listener to the relay: eight stage files, each
entered only from the stage before it, so the walk never comes back into a file it left; every
other module it calls is a helper that returns to its caller and calls no stage, except back into
the stage still running below it through a callable that stage handed it (a leg's ``consume``).

The trace profiles a real streamed P/D request through the real app (fake vLLM backends in the
same process, their frames left out), as tests/proxy/startup_trace.py does for start-up. An
*entry* is a new frame of a module called from a frame of another module (a coroutine resumed is
the same frame, not a new entry). docs/development.md draws the same walk.
"""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any

from pd_proxy.protocol.endpoints import COMPLETIONS
from tests.proxy.proxy_harness import pd_stack
from tests.proxy.startup_trace import module_chain

# The stages of a P/D completion in the order the walk first enters them, each with the one stage
# allowed to enter it (None: the web server's own code, outside pd_proxy).
WALK: dict[str, str | None] = {
    "pd_proxy.api.app": None,  # the listener's route
    "pd_proxy.pipeline": "pd_proxy.api.app",  # authenticate, parse; then the stages below
    "pd_proxy.routing.shapes": "pd_proxy.pipeline",
    "pd_proxy.routing.planner": "pd_proxy.pipeline",
    "pd_proxy.admission.gate": "pd_proxy.pipeline",
    "pd_proxy.modes.normal": "pd_proxy.pipeline",
    "pd_proxy.legs": "pd_proxy.modes.normal",  # the prefill leg, then the decode leg
    "pd_proxy.http.relay": "pd_proxy.legs",
}

# What the stages call and get back from, by default: values, pure rules, the HTTP wire,
# metrics and the request's trace.
HELPERS = {
    "pd_proxy.call",  # the parsed Call and the fields both legs add
    "pd_proxy.protocol.parse",  # the client body decoded and checked
    "pd_proxy.protocol.client_fields",  # the fields read as vLLM reads them
    "pd_proxy.routing.token_ids",  # whether the prompt is token ids (the shapes ask)
    "pd_proxy.protocol.codec",  # JSON
    "pd_proxy.protocol.pd_bodies",  # the P/D protocol's bodies
    "pd_proxy.backends.route",  # the Route value
    "pd_proxy.admission.fair_queue",
    "pd_proxy.admission.lease",
    "pd_proxy.admission.metrics",
    "pd_proxy.admission.rate",
    "pd_proxy.admission.room",
    "pd_proxy.scheduler",  # the one place a replica is chosen
    "pd_proxy.http.exchange",  # one exchange with a backend: failover, retries
    "pd_proxy.http.upstream",
    "pd_proxy.http.connection",
    "pd_proxy.metrics",
    "pd_proxy.tracing",
}
# With cache-aware routing and a local-prefill limit the planner also counts and scores.
PLANNING_HELPERS = {
    "pd_proxy.routing.token_count",
    "pd_proxy.routing.decider",
    "pd_proxy.routing.block_size",
    "pd_proxy.routing.cache.router",
    "pd_proxy.routing.cache.scorer",
    "pd_proxy.routing.cache.approx",
    "pd_proxy.routing.cache.keys",
    "pd_proxy.routing.cache.extra",
    "pd_proxy.routing.cache.pending",
}

# (calling module or None, module entered, the modules on the stack below the caller)
Entry = tuple[str | None, str, frozenset[str]]


def walk_faults(entries: list[Entry], walk: dict[str, str | None]) -> list[str]:
    """What breaks the walk: a stage entered from anywhere but the stage before it (a helper
    calling a stage, or a stage coming back into one it left) unless it is a call back into that
    stage while it still runs below; a helper twice on one stack; stages first entered out of
    order, or a stage never entered."""
    faults = [
        f"{caller} -> {module}"
        for caller, module, below in entries
        if module in walk
        and caller != walk[module]
        and (caller in walk or module not in below)  # only a helper calls back, and into a
    ]  # stage still running
    faults += [
        f"{module} again below {caller}"
        for caller, module, below in entries
        if module not in walk and module in below
    ]
    first: list[str] = []
    for _, module, _ in entries:
        if module in walk and module not in first:
            first.append(module)
    if first != list(walk):
        faults.append(f"stages entered in the order {first}, not {list(walk)}")
    return faults


async def traced_completion(**options: Any) -> list[Entry]:
    entries: list[Entry] = []
    frames: set[FrameType] = set()  # kept alive, so a new frame is never mistaken for an old one

    def profile(frame: FrameType, event: str, _arg: Any) -> None:
        if event != "call":
            return
        chain = [m for m in module_chain(frame) if not m.startswith("pd_proxy.testing")]
        if not chain or frame in frames:
            return
        module = frame.f_globals.get("__name__", "")
        if not module.startswith("pd_proxy.") or module.startswith("pd_proxy.testing"):
            return
        frames.add(frame)
        caller = chain[-2] if len(chain) > 1 else None
        if caller != module:
            entries.append((caller, module, frozenset(chain[:-2])))

    async with pd_stack(**options) as s:
        body = {"prompt": "a b c", "max_tokens": 3, "stream": True}
        status, _, raw = await s.post(COMPLETIONS, body)  # warm: connections, lazy imports
        assert status == 200, raw
        sys.setprofile(profile)
        try:
            status, _, raw = await s.post(COMPLETIONS, body)
        finally:
            sys.setprofile(None)
        assert status == 200, raw
    return entries


async def test_a_completion_walks_eight_stage_files_and_comes_back_into_none() -> None:
    entries = await traced_completion()
    assert walk_faults(entries, WALK) == []
    touched = {module for _, module, _ in entries}
    assert len(touched & WALK.keys()) <= 8
    assert touched - WALK.keys() == HELPERS


async def test_with_cache_routing_and_a_local_limit_still_one_pass() -> None:
    entries = await traced_completion(prefix_cache_routing="approx", local_prefill_max_tokens=2)
    assert walk_faults(entries, WALK) == []
    touched = {module for _, module, _ in entries}
    assert "pd_proxy.routing.cache.router" in touched and "pd_proxy.routing.token_count" in touched
    assert touched - WALK.keys() <= HELPERS | PLANNING_HELPERS, touched - WALK.keys() - HELPERS


def test_the_rules_see_a_walk_that_comes_back() -> None:
    """A helper calling a stage, a stage coming back into one it left or calling back into one
    still running, a helper twice on one stack, a stage skipped: faults. A helper calling back
    into the stage running below it is none of those."""
    walk = {"a": None, "b": "a", "c": "b"}

    def entries(*edges: tuple[str | None, str, str]) -> list[Entry]:
        return [(caller, module, frozenset(below)) for caller, module, below in edges]

    start = entries((None, "a", ""), ("a", "b", ""), ("b", "c", "a"))
    assert walk_faults(start, walk) == []
    assert walk_faults(start + entries(("b", "h", "a"), ("h", "b", "ab")), walk) == []
    assert walk_faults(start + entries(("a", "h", ""), ("h", "b", "a")), walk) == ["h -> b"]
    assert walk_faults(start + entries(("c", "b", "a")), walk) == ["c -> b"]  # b had returned
    assert walk_faults(start + entries(("c", "b", "ab")), walk) == ["c -> b"]  # a stage calls back
    assert walk_faults(start + entries(("c", "h", "abh")), walk) == ["h again below c"]
    assert walk_faults(start[:2], walk) == [
        "stages entered in the order ['a', 'b'], not ['a', 'b', 'c']"
    ]


def test_the_check_sees_a_chain_that_comes_back() -> None:
    """``module_chain`` reports a module twice when a call goes back into it."""
    import types

    outer = types.ModuleType("pd_proxy.fake_outer")
    inner = types.ModuleType("pd_proxy.fake_inner")
    exec("import sys\ndef run(inner):\n    return inner.go()\ndef helper():\n"
         "    return sys._getframe()", outer.__dict__)  # fmt: skip
    exec("import sys\ndef go():\n    return sys.modules['pd_proxy.fake_outer'].helper()",
         inner.__dict__)  # fmt: skip
    sys.modules["pd_proxy.fake_outer"] = outer
    try:
        frame = outer.run(inner)
        chain = module_chain(frame)
    finally:
        del sys.modules["pd_proxy.fake_outer"]
    assert chain.count("pd_proxy.fake_outer") == 2
