"""The line a run ends with when it skipped Kubernetes checks (tests/k8s/conftest.py)."""

from __future__ import annotations

from types import SimpleNamespace

from tests.k8s.conftest import skipped_line


def _report(nodeid: str, outcome: str, reason: str = "", k8s: bool = True) -> SimpleNamespace:
    keywords = {"k8s": 1} if k8s else {}
    longrepr = ("f.py", 1, f"Skipped: {reason}") if outcome == "skipped" else None
    return SimpleNamespace(
        nodeid=nodeid, keywords=keywords, skipped=outcome == "skipped", longrepr=longrepr
    )


def test_the_skipped_checks_are_counted_by_reason() -> None:
    stats = {
        "passed": [_report("a", "passed"), _report("other", "passed", k8s=False)],
        "skipped": [
            _report("b", "skipped", "kubectl not found"),
            _report("c", "skipped", "kubectl not found"),
            _report("d", "skipped", "promtool not found"),
            _report("e", "skipped", "not ours", k8s=False),
        ],
    }
    assert skipped_line(stats) == (
        "k8s: 3 of 4 checks skipped: kubectl not found (2); promtool not found (1)"
    )


def test_nothing_is_said_when_nothing_was_skipped() -> None:
    assert skipped_line({"passed": [_report("a", "passed")]}) == ""
    assert skipped_line({}) == ""
