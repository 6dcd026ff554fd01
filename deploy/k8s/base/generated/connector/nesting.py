"""Whether this connector is being built as a child of vLLM's ``MultiConnector``.

``MultiConnector`` builds each child itself - the connectors in its ``__init__``, their
Prometheus metrics in its ``build_prom_metrics`` classmethod - from a per-child copy of the
``VllmConfig`` whose ``kv_transfer_config`` is the child's own, with no trace of the parent. The
call stack is the one place that still says who is building us, so look there: a frame whose
``self`` is a ``MultiConnector`` (or whose ``cls`` is one) is our parent at work.
``tests/connector/test_scheduler_leak.py``'s multiconnector tests build the kit's connector
through vLLM's real ``MultiConnector``, so a vLLM that builds its children differently fails there.
"""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any


def _is_multiconnector(owner: Any, multi_cls: type) -> bool:
    if isinstance(owner, type):
        return issubclass(owner, multi_cls)
    return isinstance(owner, multi_cls)


def multiconnector_on_stack(frame: FrameType | None, multi_cls: type) -> bool:
    """True when ``frame`` or a caller runs a method of ``multi_cls`` (an instance or a class)."""
    while frame is not None:
        local = frame.f_locals
        for name in ("self", "cls"):
            if name in local and _is_multiconnector(local[name], multi_cls):
                return True
        frame = frame.f_back
    return False


def inside_multiconnector() -> bool:
    """True when vLLM's ``MultiConnector`` (or a subclass) is building the caller."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector
    except ImportError:  # no MultiConnector in this vLLM: nothing can nest us
        return False
    return multiconnector_on_stack(sys._getframe(1), MultiConnector)
