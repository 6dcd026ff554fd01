"""Topology and counting rules over a table of TP/PP/PCP/DCP/role combinations."""

from __future__ import annotations

import pytest

from pcp_nixl_connector.topology import (
    CompletionMode,
    PcpLayout,
    layout_from_config,
    parse_completion_mode,
    pcp_rank_from_global_rank,
    requested_completion_mode,
    resolve_completion_mode,
)

C, W = CompletionMode.CANONICAL, CompletionMode.WORLD_SIZE

# tp, pp, pcp, dcp, role, mode -> replicated?, finished_count, expected_reports, canonical ranks
TABLE = [
    (1, 1, 1, 1, "kv_producer", C, False, None, 1, {0}),
    (1, 1, 2, 1, "kv_producer", C, True, 1, 1, {0}),
    (1, 1, 2, 1, "kv_producer", W, True, None, 2, {0}),
    (2, 1, 2, 1, "kv_producer", C, True, 2, 2, {0}),
    (2, 2, 2, 1, "kv_producer", C, True, 4, 4, {0}),
    (4, 1, 4, 1, "kv_producer", C, True, 4, 4, {0}),
    (2, 3, 4, 1, "kv_producer", W, True, None, 24, {0}),
    (1, 1, 2, 2, "kv_producer", C, False, None, 2, {0, 1}),  # PCP+DCP: sharded, stock
    (4, 1, 1, 2, "kv_producer", C, False, None, 4, {0}),
    (1, 1, 1, 1, "kv_consumer", C, False, None, 1, {0}),
    (2, 2, 1, 1, "kv_consumer", C, False, None, 4, {0}),
    (2, 1, 2, 1, "kv_both", C, False, None, 4, {0, 1}),
]


@pytest.mark.parametrize(
    "tp,pp,pcp,dcp,role,mode,replicated,count,expected,canonical", TABLE, ids=str
)
def test_layout_table(tp, pp, pcp, dcp, role, mode, replicated, count, expected, canonical):
    layout = PcpLayout(tp=tp, pp=pp, pcp=pcp, dcp=dcp, kv_role=role, mode=mode)
    assert layout.world_size == tp * pp * pcp
    assert layout.replicated_pcp_producer is replicated
    assert layout.finished_count() == count
    assert layout.expected_reports() == expected
    got_canonical = {r for r in range(pcp) if layout.is_canonical(r)}
    assert got_canonical == canonical
    for rank in range(pcp):
        canon = rank in canonical
        assert layout.publishes_handshake(rank) is canon
        assert layout.suppresses_finished_sending(rank) is (not canon and mode is C)


@pytest.mark.parametrize("tp,pp,pcp,dcp,role,mode,replicated,count,expected,canonical", TABLE)
def test_reports_match_what_the_scheduler_waits_for(
    tp, pp, pcp, dcp, role, mode, replicated, count, expected, canonical
):
    """The consistency invariant: reporting ranks == reports awaited."""
    layout = PcpLayout(tp=tp, pp=pp, pcp=pcp, dcp=dcp, kv_role=role, mode=mode)
    reporting = sum(
        1 for _ in range(tp * pp) for r in range(pcp) if not layout.suppresses_finished_sending(r)
    )
    assert reporting == layout.reporting_ranks() == layout.expected_reports()
    # The exported gauge: suppressed reports per canonical completion, per request.
    suppressed = sum(
        1 for _ in range(tp * pp) for r in range(pcp) if layout.suppresses_finished_sending(r)
    )
    canonical_reports = sum(1 for _ in range(tp * pp) for r in range(pcp) if r in canonical)
    assert suppressed == layout.expected_suppressed_per_completion() * canonical_reports
    assert layout.expected_suppressed_per_completion() == (
        pcp - 1 if replicated and mode is C else 0
    )


def test_every_canonical_rank_of_a_replicated_layout_is_pcp_rank_zero():
    layout = PcpLayout(tp=2, pp=2, pcp=4, dcp=1, kv_role="kv_producer")
    canonical_globals = [
        g
        for g in range(layout.world_size)
        if layout.is_canonical(pcp_rank_from_global_rank(g, tp=2, pp=2, pcp=4))
    ]
    # (pp, pcp, tp) layout, TP fastest: PCP rank 0 is the first TP block of each PP stage.
    assert canonical_globals == [0, 1, 8, 9]


@pytest.mark.parametrize(
    "rank,tp,pp,pcp,want",
    [(0, 1, 1, 2, 0), (1, 1, 1, 2, 1), (3, 2, 1, 2, 1), (2, 2, 1, 2, 1), (5, 2, 2, 2, 0)],
)
def test_pcp_rank_from_global_rank(rank, tp, pp, pcp, want):
    assert pcp_rank_from_global_rank(rank, tp, pp, pcp) == want


@pytest.mark.parametrize(
    "extra,want",
    [(None, C), ({}, C), ({"pcp_completion_mode": "world_size"}, W), ({"x": 1}, C)],
)
def test_parse_completion_mode(extra, want):
    assert parse_completion_mode(extra) is want


@pytest.mark.parametrize("bad", ["World_Size", "tp_pp", 2, None])
def test_parse_completion_mode_rejects_bad_values(bad):
    with pytest.raises(ValueError, match="pcp_completion_mode"):
        parse_completion_mode({"pcp_completion_mode": bad})


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(tp=0, pp=1, pcp=1, dcp=1, kv_role="kv_producer"), "tp"),
        (dict(tp=1, pp=1, pcp=True, dcp=1, kv_role="kv_producer"), "pcp"),
        (dict(tp=1, pp=1, pcp=1, dcp=1, kv_role="producer"), "kv_role"),
        (dict(tp=1, pp=1, pcp=1, dcp=1, kv_role="kv_producer", mode="canonical"), "mode"),
    ],
)
def test_layout_rejects_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PcpLayout(**kwargs)


@pytest.mark.parametrize("rank", [-1, 2, 1.0])
def test_rank_out_of_range_is_an_error(rank):
    layout = PcpLayout(tp=1, pp=1, pcp=2, dcp=1, kv_role="kv_producer")
    with pytest.raises(ValueError, match="pcp_rank"):
        layout.is_canonical(rank)


@pytest.mark.parametrize(
    "requested,wrapper,replicated,want",
    [
        (None, None, True, C),  # on its own: canonical by default
        (None, "MultiConnector", True, W),  # inside a wrapper: world_size by itself
        (None, "MultiConnector", False, W),
        (W, "MultiConnector", True, W),
        (W, None, True, W),
        (C, None, True, C),
        (C, "MultiConnector", False, C),  # canonical only matters for a replicated-PCP producer
    ],
)
def test_resolve_completion_mode(requested, wrapper, replicated, want):
    got = resolve_completion_mode(requested, wrapper=wrapper, replicated_pcp_producer=replicated)
    assert got is want


def test_explicit_canonical_inside_a_wrapper_is_refused_naming_setting_and_wrapper():
    with pytest.raises(ValueError, match=r"\['pcp_completion_mode'\] = 'canonical' inside Multi"):
        resolve_completion_mode(C, wrapper="MultiConnector", replicated_pcp_producer=True)


@pytest.mark.parametrize(
    "extra,want", [(None, None), ({}, None), ({"pcp_completion_mode": "canonical"}, C)]
)
def test_requested_completion_mode_tells_unset_from_canonical(extra, want):
    assert requested_completion_mode(extra) is want


def test_layout_from_config_resolves_the_mode_for_its_place():
    from types import SimpleNamespace

    parallel = SimpleNamespace(
        tensor_parallel_size=1,
        pipeline_parallel_size=1,
        prefill_context_parallel_size=2,
        decode_context_parallel_size=1,
    )
    ktc = SimpleNamespace(kv_role="kv_producer", kv_connector_extra_config={})
    cfg = SimpleNamespace(kv_transfer_config=ktc, parallel_config=parallel)
    assert layout_from_config(cfg).mode is C
    assert layout_from_config(cfg, wrapper="MultiConnector").mode is W
    assert layout_from_config(cfg, wrapper="MultiConnector").finished_count() is None
