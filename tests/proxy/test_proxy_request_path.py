"""One completion's path through pd-proxy reads in one pass: from the listener to the relay no
call chain comes back into a module it already left, and the stages are the pipeline's own.

The trace profiles a real streamed P/D request through the real app (fake vLLM backends in the
same process, their frames left out), as tests/proxy/startup_trace.py does for start-up.
"""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any

from pd_proxy.rewrite import COMPLETIONS
from tests.proxy.proxy_harness import pd_stack
from tests.proxy.startup_trace import module_chain

# The stages a P/D completion walks, in the order the pipeline's docstring gives them.
STAGES = (
    "pd_proxy.api.app",  # the listener's route
    "pd_proxy.pipeline",  # authenticate, parse, shape, plan, admit
    "pd_proxy.routing.shapes",
    "pd_proxy.routing.planner",
    "pd_proxy.admission.gate",
    "pd_proxy.modes.normal",
    "pd_proxy.legs",
    "pd_proxy.http.relay",
)


async def traced_completion(**options: Any) -> tuple[set[str], set[tuple[str, ...]]]:
    seen: set[str] = set()
    reentries: set[tuple[str, ...]] = set()

    def profile(frame: FrameType, event: str, _arg: Any) -> None:
        if event != "call":
            return
        chain = [m for m in module_chain(frame) if not m.startswith("pd_proxy.testing")]
        if not chain:
            return
        seen.add(chain[-1])
        if len(set(chain)) != len(chain):
            reentries.add(tuple(chain))

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
    return seen, reentries


async def test_a_completion_comes_back_into_no_module() -> None:
    seen, reentries = await traced_completion()
    assert reentries == set(), sorted(reentries)
    missing = [stage for stage in STAGES if stage not in seen]
    assert missing == [], missing


async def test_with_cache_routing_and_a_local_limit_still_one_pass() -> None:
    seen, reentries = await traced_completion(
        prefix_cache_routing="approx", local_prefill_max_tokens=2
    )
    assert reentries == set(), sorted(reentries)
    assert "pd_proxy.routing.cache.router" in seen and "pd_proxy.routing.token_count" in seen


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
