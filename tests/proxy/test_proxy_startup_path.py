"""pd-proxy's start-up reads in one pass: no call chain goes back into a module it already left.

The old start-up crossed 13 modules with 11 returns to modules already on the stack (cli ->
config -> workers -> cli.run, code in strings included). The trace runs the real ``cli.main``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import types

from tests.proxy.startup_trace import module_chain, trace
from tests.support.paths import REPO


def test_startup_enters_no_module_twice_on_one_call_chain() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "tests.proxy.startup_trace"],
        capture_output=True, text=True, timeout=120, check=True, cwd=REPO,
    )  # fmt: skip
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["rc"] == 0, out.stderr[-2000:]
    # The trace really followed the start-up path (composition root, checks, serving, parts).
    for module in ("pd_proxy.cli", "pd_proxy.config.flags", "pd_proxy.api.startup_checks",
                   "pd_proxy.serve", "pd_proxy.api.app", "pd_proxy.http.upstream"):  # fmt: skip
        assert module in result["seen"], result["seen"]
    assert result["reentries"] == []


def test_the_trace_flags_a_chain_that_comes_back() -> None:
    """The check can fail: a module whose function calls into another that calls back."""
    outer = types.ModuleType("pkgx.outer")
    inner = types.ModuleType("pkgx.inner")
    exec("def run(inner):\n    return inner.go()\ndef helper():\n    return 1", outer.__dict__)
    exec("import sys\ndef go():\n    return sys.modules['pkgx.outer'].helper()", inner.__dict__)
    sys.modules["pkgx.outer"] = outer
    try:
        seen, reentries = trace(lambda: outer.run(inner), package="pkgx")
    finally:
        del sys.modules["pkgx.outer"]
    assert seen == {"pkgx.outer", "pkgx.inner"}
    assert reentries == {("pkgx.outer", "pkgx.inner", "pkgx.outer")}
    assert module_chain(None) == []
