"""The test suite's port picker: ports asked for one at a time never coincide."""

from __future__ import annotations

import random

import pytest

from tests.support import net


def test_separate_calls_never_hand_out_the_same_port(monkeypatch: pytest.MonkeyPatch) -> None:
    # The worst case for separate calls: every shuffle yields the same order, and nothing binds
    # the first port before the second is asked for (as when compose gets four ports in its env).
    monkeypatch.setattr(random, "shuffle", lambda seq: None)
    monkeypatch.setattr(net, "_handed_out", set())
    ports = [net.free_port() for _ in range(4)] + net.free_ports(3)
    assert len(set(ports)) == len(ports), ports


def test_running_out_says_how_many_were_handed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    low, high = net.PORT_RANGE
    monkeypatch.setattr(net, "_handed_out", set(range(low, high)))
    with pytest.raises(RuntimeError, match="already handed out"):
        net.free_port()
