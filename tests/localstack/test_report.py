import dataclasses

import pytest

from pcp_pd_kit.localstack.report import (
    PrefillView,
    dedup_invariants,
    failed,
    format_report,
    kv_crossed_nixl,
    parse_metrics,
    query_value,
    requests_served,
    targets_up,
    total,
)

DECODE_OK = """
# TYPE vllm:prompt_tokens_by_source_total counter
vllm:prompt_tokens_by_source_total{engine="0",source="local_compute"} 0.0
vllm:prompt_tokens_by_source_total{engine="0",source="external_kv_transfer"} 56.0
# TYPE vllm:nixl_xfer_time_seconds histogram
vllm:nixl_xfer_time_seconds_bucket{engine="0",le="+Inf"} 4.0
vllm:nixl_xfer_time_seconds_count{engine="0"} 4.0
vllm:nixl_xfer_time_seconds_sum{engine="0"} 0.01
# TYPE vllm:nixl_num_failed_transfers_total counter
vllm:nixl_num_failed_transfers_total{engine="0"} 0.0
"""
PROXY = """
# TYPE pd_proxy_requests_total counter
pd_proxy_requests_total{endpoint="/v1/completions",path="pd",status="200"} 2.0
pd_proxy_requests_total{endpoint="/v1/completions",path="local",status="200"} 1.0
pd_proxy_requests_total{endpoint="/v1/completions",path="pd",status="503"} 2.0
"""


def test_parse_keeps_label_filters_and_absent_is_none() -> None:
    samples = parse_metrics(DECODE_OK)
    assert total(samples, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == 56
    assert total(samples, "vllm:prompt_tokens_by_source_total") == 56
    assert total(samples, "vllm:does_not_exist_total") is None


def test_kv_checks_pass_on_healthy_decode_and_fail_when_local_only() -> None:
    assert not failed(kv_crossed_nixl(parse_metrics(DECODE_OK)))
    local_only = DECODE_OK.replace('external_kv_transfer"} 56.0', 'external_kv_transfer"} 0.0')
    local_only = local_only.replace('_count{engine="0"} 4.0', '_count{engine="0"} 0.0')
    bad = failed(kv_crossed_nixl(parse_metrics(local_only)))
    assert [c.name for c in bad] == [
        "decode received prompt KV over NIXL",
        "NIXL transfers happened",
    ]


def test_failed_transfers_or_missing_metric_fail() -> None:
    broken = DECODE_OK.replace('transfers_total{engine="0"} 0.0', 'transfers_total{engine="0"} 2.0')
    assert [c.name for c in failed(kv_crossed_nixl(parse_metrics(broken)))] == [
        "no failed NIXL transfers"
    ]
    assert len(failed(kv_crossed_nixl([]))) == 3


def test_requests_served_counts_only_2xx() -> None:
    check = requests_served(parse_metrics(PROXY))
    assert check.ok and "3 succeeded of 5" in check.detail
    assert "(P/D 2, decode alone 1)" in check.detail
    only_errors = PROXY.replace('status="200"', 'status="502"')
    assert not requests_served(parse_metrics(only_errors)).ok


def _targets(*health: tuple[str, str]) -> dict:
    return {
        "status": "success",
        "data": {"activeTargets": [{"labels": {"job": j}, "health": h} for j, h in health]},
    }


def test_targets_up_requires_every_job_up() -> None:
    jobs = ("prefill", "decode")
    assert targets_up(_targets(("prefill", "up"), ("decode", "up")), jobs).ok
    down = targets_up(_targets(("prefill", "up"), ("decode", "down")), jobs)
    assert not down.ok and "decode=down" in down.detail
    missing = targets_up(_targets(("prefill", "up")), jobs)
    assert not missing.ok and "missing jobs: decode" in missing.detail
    assert not targets_up({"data": {"activeTargets": []}}, ()).ok


def _vector(*values: str) -> dict:
    return {
        "status": "success",
        "data": {"resultType": "vector", "result": [{"value": [0, v]} for v in values]},
    }


def test_query_value_sums_series_and_distinguishes_absent() -> None:
    assert query_value(_vector("4", "0")) == 4
    assert query_value(_vector()) is None
    assert query_value({"status": "error"}) is None


def _view(**changes: float | None) -> PrefillView:
    # A settled PCP2 producer after 4 P/D requests: 4 completions, 4 suppressed, 1 skip.
    base = dict(
        skipped=1.0,
        suppressed=4.0,
        canonical=4.0,
        expected_per_completion=1.0,
        held=4.0,
        kv_usage=0.0,
    )
    return PrefillView(**{**base, **changes})  # type: ignore[arg-type]


def test_dedup_invariants_hold_for_a_settled_pcp2_producer() -> None:
    assert not failed(dedup_invariants(_view(), pcp=2))


@pytest.mark.parametrize(
    ("changes", "pcp", "broken"),
    [
        ({"canonical": 3.0}, 2, "canonical completions = P/D requests held"),
        ({"canonical": 0.0, "held": 0.0, "suppressed": 0.0}, 2, "canonical"),
        ({"suppressed": 0.0}, 2, "suppressed duplicates"),
        ({"expected_per_completion": 0.0}, 2, "suppressed duplicates"),
        ({"skipped": 0.0}, 2, "handshake publication skipped"),
        ({"kv_usage": 0.0003}, 2, "prefill KV cache back to 0"),
        ({"suppressed": None}, 2, "suppressed duplicates"),
        ({}, 1, "suppressed duplicates"),  # a PCP1 layout must suppress nothing
    ],
)
def test_dedup_invariants_name_what_broke(
    changes: dict[str, float | None], pcp: int, broken: str
) -> None:
    bad = [c.name for c in failed(dedup_invariants(_view(**changes), pcp=pcp))]
    assert bad and bad[0].startswith(broken), bad


def test_stock_connector_leak_shape_fails_the_checks() -> None:
    """Stock vLLM with replicated PCP: no skip, no suppression, completions never counted, and
    the request's blocks still held - every invariant fails."""
    stock = _view(skipped=0.0, suppressed=0.0, canonical=0.0, expected_per_completion=None)
    names = [
        c.name for c in failed(dedup_invariants(dataclasses.replace(stock, kv_usage=0.0003), pcp=2))
    ]
    assert len(names) == 4


def test_format_report_marks_each_check() -> None:
    text = format_report(kv_crossed_nixl([]))
    assert text.count("[FAIL]") == 3 and "[PASS]" not in text
