"""The scheduler side of the handover breakdown: what it follows is bounded by the requests vLLM
holds (aborts included), FIRST_TOKEN waits for the token itself (async scheduling schedules a
step before the previous one's output is in), and a MultiConnector sibling's requests are not
ours. vLLM's NIXL scheduler underneath is a stand-in: these hooks only pass through to it."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from pcp_nixl_connector import handover as h
from pcp_nixl_connector.metric_names import HANDOVER_EVENTS_KEY, HANDOVER_PENDING_KEY

pytestmark = pytest.mark.vllm


class _NixlSchedulerStandIn:
    def update_state_after_alloc(self, *args: Any) -> None:
        return None

    def update_connector_output(self, output: Any) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> None:
        return None

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, None]:
        return bool((request.kv_transfer_params or {}).get("do_remote_decode")), None


def _scheduler_side() -> Any:
    from pcp_nixl_connector import PcpCanonicalNixlConnector

    connector = object.__new__(PcpCanonicalNixlConnector)
    connector._init_handover_tracking()
    connector.connector_scheduler = _NixlSchedulerStandIn()
    connector.connector_worker = None
    return connector


def _decode_request(rid: str) -> Any:
    return SimpleNamespace(request_id=rid, kv_transfer_params={"do_remote_prefill": True})


def _with_tokens(request: Any, n: int) -> None:
    request.num_output_tokens = n


def _output(recv: set[str] | None = None, sent: set[str] | None = None) -> Any:
    from vllm.v1.outputs import KVConnectorOutput

    return KVConnectorOutput(finished_recving=recv, finished_sending=sent)


def _scheduled(*rids: str) -> Any:
    return SimpleNamespace(num_scheduled_tokens={rid: 1 for rid in rids})


def _shipped(connector: Any) -> tuple[list[tuple[str, str]], list[int]]:
    stats = connector.get_kv_connector_stats()
    if stats is None:
        return [], []
    events = [(rid, name) for rid, name, _ in stats.data.get(HANDOVER_EVENTS_KEY, [])]
    return events, list(stats.data.get(HANDOVER_PENDING_KEY, []))


def test_an_abort_while_kv_is_in_flight_leaves_nothing_behind() -> None:
    """Aborted first (vLLM finishes the request), its finished_recving after: nothing is kept
    and the pending gauge goes back to 0 (the set used to keep the request for good)."""
    c = _scheduler_side()
    aborted = _decode_request("aborted")
    _with_tokens(aborted, 0)
    c.update_state_after_alloc(aborted, None, 16)
    c.request_finished(aborted, [1])  # the client left: vLLM frees the request
    c.update_connector_output(_output(recv={"aborted"}))
    c.build_connector_meta(_scheduled())
    assert not c._awaiting_first_step
    events, pending = _shipped(c)
    assert ("aborted", h.SCHEDULER_SEEN) not in events
    assert pending[-1] == 0 and max(pending) == 1


def test_first_token_is_stamped_when_the_token_is_in_not_when_scheduled() -> None:
    """Async scheduling: the request's first step is scheduled, then the next step is scheduled
    before the first one's output arrives. FIRST_TOKEN waits for the token."""
    c = _scheduler_side()
    req = _decode_request("r")
    _with_tokens(req, 0)
    c.update_state_after_alloc(req, None, 16)
    c.update_connector_output(_output(recv={"r"}))
    c.build_connector_meta(_scheduled("r"))  # step N: the first decode step
    c.build_connector_meta(_scheduled("r"))  # step N+1, scheduled before N's output is in
    events, _ = _shipped(c)
    assert ("r", h.FIRST_TOKEN) not in events
    _with_tokens(req, 1)  # step N's output: the token is appended
    c.update_connector_output(_output())
    events, pending = _shipped(c)
    assert events == [("r", h.FIRST_TOKEN)]
    assert pending == [0] and not c._awaiting_first_step


def test_a_request_ended_by_its_first_token_is_stamped_once() -> None:
    c = _scheduler_side()
    req = _decode_request("one")
    _with_tokens(req, 0)
    c.update_state_after_alloc(req, None, 16)
    c.update_connector_output(_output(recv={"one"}))
    _with_tokens(req, 1)
    c.request_finished(req, [1])  # max_tokens=1: freed in the same output
    c.update_connector_output(_output())
    events, _ = _shipped(c)
    assert [e for e in events if e[1] == h.FIRST_TOKEN] == [("one", h.FIRST_TOKEN)]


def test_a_siblings_requests_are_not_stamped() -> None:
    """Inside a MultiConnector the output carries every child's finished requests: only those
    this connector admitted or held get events."""
    c = _scheduler_side()
    held = SimpleNamespace(
        request_id="ours", kv_transfer_params={"do_remote_decode": True}, num_output_tokens=1
    )
    c.request_finished(held, [1])  # prefill: KV held for decode
    c.update_connector_output(_output(recv={"sibling-load"}, sent={"sibling-save", "ours"}))
    c.build_connector_meta(_scheduled("sibling-load"))
    events, pending = _shipped(c)
    assert events == [("ours", h.PREFILL_DONE), ("ours", h.BLOCKS_FREED)]
    assert pending == [1, 0]
    assert not c._held and not c._awaiting_first_step
