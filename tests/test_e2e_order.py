"""The e2e package's order: the first-request check asks the shared stack first (its first request
is the one it checks), and the prefill-replacing A/B test runs after every other e2e test, inside
the package's block (its stack is package-scoped)."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace
from typing import Any

from tests.e2e.conftest import first_in_package, last_in_package
from tests.support.paths import REPO


def _item(path: str, marked: bool = False) -> Any:
    return SimpleNamespace(
        path=path, get_closest_marker=lambda name: object() if marked and name == "m" else None
    )


def test_marked_tests_move_to_the_end_of_their_package_block_only() -> None:
    a, b = _item("/t/a/x.py"), _item("/t/e2e/1.py")
    stock, shapes = _item("/t/e2e/2.py", marked=True), _item("/t/e2e/3.py")
    z = _item("/t/z.py")
    items = [a, b, stock, shapes, z]
    assert last_in_package(items, "/t/e2e/", "m") == [a, b, shapes, stock, z]
    assert last_in_package([a, z], "/t/e2e/", "m") == [a, z]


def test_marked_tests_move_to_the_start_of_their_package_block_only() -> None:
    a, b = _item("/t/a/x.py"), _item("/t/e2e/1.py")
    first, shapes = _item("/t/e2e/2.py", marked=True), _item("/t/e2e/3.py")
    z = _item("/t/z.py")
    assert first_in_package([a, b, first, shapes, z], "/t/e2e/", "m") == [a, first, b, shapes, z]
    assert first_in_package([a, z], "/t/e2e/", "m") == [a, z]


def test_the_e2e_suite_opens_with_the_first_request_and_ends_with_the_stock_ab() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "e2e", "tests/e2e"],
        capture_output=True, text=True, timeout=120, check=True, cwd=REPO,
    )  # fmt: skip
    ids = [line for line in out.stdout.splitlines() if "::" in line]
    assert ids[0].endswith("test_first_request.py::test_first_request_after_start_is_answered")
    assert ids[-1].endswith("test_stock_nixl_connector_leaks_the_same_request_the_kit_frees")
    assert any("test_request_shapes" in i for i in ids)
