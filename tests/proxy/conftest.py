"""Run ``async def`` tests of this directory on a fresh event loop (no pytest-asyncio needed)."""

from __future__ import annotations

import asyncio
import inspect

import pytest

# Safety net against hangs; the suite's own waits are far shorter.
ASYNC_TEST_TIMEOUT_S = 60


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function):
    if not inspect.iscoroutinefunction(pyfuncitem.obj):
        return None
    names = pyfuncitem._fixtureinfo.argnames
    kwargs = {name: pyfuncitem.funcargs[name] for name in names}
    asyncio.run(asyncio.wait_for(pyfuncitem.obj(**kwargs), ASYNC_TEST_TIMEOUT_S))
    return True
