"""resolve_pcp_rank: vLLM's PCP group when it exists, else the global rank layout (no asserts)."""

from __future__ import annotations

import types

import pytest

from pcp_nixl_connector.topology import PcpLayout

pytestmark = pytest.mark.vllm

LAYOUT = PcpLayout(tp=2, pp=1, pcp=2, dcp=1, kv_role="kv_producer")


@pytest.fixture
def ps(monkeypatch):
    from vllm.distributed import parallel_state

    monkeypatch.setattr(parallel_state, "_PCP", None)
    return parallel_state


def test_pcp_group_rank_wins(ps, monkeypatch):
    from pcp_nixl_connector.connector import resolve_pcp_rank

    monkeypatch.setattr(ps, "_PCP", types.SimpleNamespace(rank_in_group=1))
    assert resolve_pcp_rank(LAYOUT) == 1


def test_falls_back_to_global_rank_without_pcp_group(ps, monkeypatch):
    import torch.distributed as dist

    from pcp_nixl_connector.connector import resolve_pcp_rank

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda: 3)  # (pcp, tp) = (1, 1) with TP fastest
    assert resolve_pcp_rank(LAYOUT) == 1
    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    assert resolve_pcp_rank(LAYOUT) == 0


def test_no_group_and_no_torch_distributed_is_a_clear_error(ps, monkeypatch):
    import torch.distributed as dist

    from pcp_nixl_connector.connector import resolve_pcp_rank

    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    with pytest.raises(RuntimeError, match="canonical replica is unknown"):
        resolve_pcp_rank(LAYOUT)
    assert resolve_pcp_rank(PcpLayout(tp=2, pp=1, pcp=1, dcp=1, kv_role="kv_producer")) == 0
