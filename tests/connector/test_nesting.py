"""The MultiConnector detection's stack walk, on stand-in classes (no vLLM)."""

from __future__ import annotations

import sys

from pcp_nixl_connector.nesting import multiconnector_on_stack


class Multi:
    def __init__(self) -> None:
        self.child = Child()

    @classmethod
    def build_metrics(cls) -> Child:
        return Child()


class SubMulti(Multi):
    pass


class Child:
    def __init__(self) -> None:
        self.nested = multiconnector_on_stack(sys._getframe(), Multi)


def test_a_child_built_in_a_multiconnector_method_or_classmethod_sees_it() -> None:
    assert Multi().child.nested
    assert SubMulti().child.nested
    assert Multi.build_metrics().nested
    assert SubMulti.build_metrics().nested


def test_a_child_built_elsewhere_does_not() -> None:
    assert not Child().nested
    assert not multiconnector_on_stack(None, Multi)
