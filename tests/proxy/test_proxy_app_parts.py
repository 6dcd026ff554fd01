"""pd_proxy.api.app builds its parts once, in order: the loop-free ones with the app, the rest when
it
starts, each complete when built (no part set on another later), all closed in reverse on stop."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from pd_proxy.api import app as app_module
from pd_proxy.api.app import PROXY_KEY, RUNNING_KEY, build_app, make_runner
from pd_proxy.config import ProxyConfig
from tests.proxy.proxy_harness import pd_stack
from tests.support.net import closed_port_url


async def test_started_parts_are_complete_frozen_and_closed_on_stop() -> None:
    async with pd_stack(canary_minutes=60.0) as s:
        running = s.running
        # One session and one upstream client, handed to every part that uses them at its birth.
        assert running.legs.exchange.upstream is running.upstream
        assert running.side.session is running.session
        assert running.checker.session is running.session
        assert running.canary is not None and running.canary.legs is running.legs
        with pytest.raises(dataclasses.FrozenInstanceError):
            running.checker = None  # type: ignore[misc]
        with pytest.raises(dataclasses.FrozenInstanceError):
            s.proxy.discovery = None  # type: ignore[misc]
        status, _, _ = await s.post("/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert status == 200
    assert running.session.closed
    assert running.upstream._closed
    assert running.canary._task is None


def test_nothing_that_needs_a_loop_is_built_with_the_app() -> None:
    app = build_app(ProxyConfig(prefill=("http://p:1",), decode=("http://d:1",)))
    assert RUNNING_KEY not in app
    assert [b.url for b in app[PROXY_KEY].prefill_pool.backends] == ["http://p:1"]


async def test_a_start_that_fails_half_way_closes_what_it_built(monkeypatch) -> None:
    """The first health round fails with a bug: the checker task is stopped, and the session and
    upstream client built before it are closed."""

    async def broken_first_round(checker, timeout: float) -> None:
        raise RuntimeError("bug in the first round")

    monkeypatch.setattr(app_module, "_first_round", broken_first_round)
    config = ProxyConfig(prefill=(closed_port_url(),), decode=(closed_port_url(),))
    app = build_app(config)
    runner = make_runner(app, config)
    with pytest.raises(RuntimeError, match="bug in the first round"):
        await runner.setup()
    running = app[RUNNING_KEY]
    assert running.session.closed and running.upstream._closed
    names = {t.get_name() for t in asyncio.all_tasks() if not t.done()}
    assert "pd-proxy-health" not in names
    await runner.cleanup()
