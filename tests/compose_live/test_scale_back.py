"""When test_replicas.py scales the session stack back to one prefill replica: only when a later
test needs one (scaling back is a full prefill start). No Docker needed."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from tests.compose_live.conftest import ANY_PREFILL_REPLICAS, one_replica_needed


def _item(fixtures: tuple[str, ...], marked: bool = False) -> Any:
    def marker(name: str) -> object | None:
        return object() if marked and name == ANY_PREFILL_REPLICAS else None

    return SimpleNamespace(fixturenames=list(fixtures), get_closest_marker=marker)


def test_only_the_down_check_after_it_leaves_two_replicas() -> None:
    down = _item(("compose_stack",), marked=True)
    unit = _item(("tmp_path",))
    assert not one_replica_needed([down])
    assert not one_replica_needed([unit, down])
    assert not one_replica_needed([])


def test_a_later_test_on_the_session_stack_gets_one_replica_back() -> None:
    live = _item(("compose_stack", "two_prefills"))
    assert one_replica_needed([live])
    assert one_replica_needed([_item(("compose_stack",), marked=True), _item(("compose_stack",))])
