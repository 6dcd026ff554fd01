"""The local stack's warm-up loop: retries failed requests, stops at the first answer, and
fails with every failure named; the stack warms only when proxy, prefill and decode all run."""

from __future__ import annotations

from pathlib import Path

import pytest

from pcp_pd_kit.localstack import warmup
from pcp_pd_kit.localstack.live import HttpError
from pcp_pd_kit.localstack.stack import Stack
from tests.support.env import example_settings


class Sender:
    """Fails with the given statuses in turn, then answers."""

    def __init__(self, statuses: list[int | None]) -> None:
        self.statuses = list(statuses)
        self.calls = 0

    def __call__(self) -> None:
        self.calls += 1
        if self.statuses:
            raise HttpError("http://proxy/v1/completions", self.statuses.pop(0), "stalled")


class FakeProcess:
    def __init__(self, spec: object, log_dir: Path) -> None:
        self.spec = spec

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass


def _run(sender: Sender, attempts: int = 3) -> tuple[warmup.WarmupResult, list[float]]:
    pauses: list[float] = []
    result = warmup.warm_up(sender, attempts=attempts, pause_s=0.5, sleep=pauses.append)
    return result, pauses


def test_first_answer_ends_the_warm_up() -> None:
    sender = Sender([])
    result, pauses = _run(sender)
    assert (sender.calls, result.failures, pauses) == (1, (), [])


def test_a_stalled_try_is_retried_and_reported() -> None:
    sender = Sender([504, None])
    result, pauses = _run(sender)
    assert sender.calls == 3
    assert pauses == [0.5, 0.5]
    assert len(result.failures) == 2
    assert "try 1" in result.failures[0] and "504" in result.failures[0]
    assert "no answer" in result.failures[1]


def test_every_try_failing_is_an_error_naming_them() -> None:
    sender = Sender([504, 502, 504])
    with pytest.raises(warmup.WarmupError, match="3 tries") as info:
        _run(sender)
    assert sender.calls == 3
    assert "502" in str(info.value) and "try 3" in str(info.value)


def test_no_pause_after_the_last_try() -> None:
    pauses: list[float] = []
    with pytest.raises(warmup.WarmupError):
        warmup.warm_up(Sender([504]), attempts=1, sleep=pauses.append)
    assert pauses == []


def test_attempts_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="attempts"):
        warmup.warm_up(Sender([]), attempts=0)


@pytest.mark.parametrize(
    ("parts", "warm", "warms"),
    [
        (("prefill", "decode", "proxy", "prometheus"), True, True),
        (("prefill", "decode", "proxy"), True, True),
        (("prefill", "decode", "proxy"), False, False),
        (("reference",), True, False),
        (("prefill", "decode", "prometheus"), True, False),
    ],
)
def test_stack_warms_only_a_whole_pd_path(
    parts: tuple[str, ...],
    warm: bool,
    warms: bool,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """start() with every process faked: the warm-up runs exactly when asked for and possible."""
    sent: list[str] = []
    stack = Stack(example_settings(), parts=parts, work_dir=tmp_path, warm=warm)
    monkeypatch.setattr("pcp_pd_kit.localstack.stack.host.ensure_ports_free", lambda *a: None)
    monkeypatch.setattr(
        "pcp_pd_kit.localstack.stack.resolve_model",
        lambda *a: type("M", (), {"path": "m", "served_name": "m"})(),
    )
    monkeypatch.setattr(Stack, "_spec", lambda self, part, settings=None: part)
    monkeypatch.setattr("pcp_pd_kit.localstack.stack.ManagedProcess", FakeProcess)
    monkeypatch.setattr("pcp_pd_kit.localstack.stack.wait_healthy", lambda procs, timeout: None)
    monkeypatch.setattr(
        warmup, "proxy_sender", lambda url, model, timeout_s, *rest: lambda: sent.append(url)
    )
    stack.start()
    assert sent == ([stack.urls["proxy"]] if warms else [])
    assert (stack.warmup is not None) == warms
