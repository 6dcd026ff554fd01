from pcp_pd_kit.localstack.report import (
    dedup_counters,
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
pd_proxy_requests_total{endpoint="/v1/completions",status="200"} 3.0
pd_proxy_requests_total{endpoint="/v1/completions",status="503"} 2.0
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
    only_errors = PROXY.replace('status="200"} 3.0', 'status="502"} 3.0')
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


def test_dedup_counters_present_and_canonical_positive() -> None:
    names = (
        "vllm:nixl_pcp_handshake_publications_skipped_total",
        "vllm:nixl_pcp_finished_sending_suppressed_total",
        "vllm:nixl_pcp_canonical_completions_total",
        "vllm:nixl_pcp_expected_suppressed_per_completion",
    )
    good = dedup_counters(
        {
            names[0]: _vector("0"),
            names[1]: _vector("0"),
            names[2]: _vector("4"),
            names[3]: _vector("0"),
        }
    )
    assert not failed(good)
    assert failed(dedup_counters({**dict.fromkeys(names[:3], _vector("4")), names[3]: _vector()}))
    bad = dedup_counters({names[0]: _vector(), names[1]: _vector("0"), names[2]: _vector("0")})
    assert [c.name for c in failed(bad)] == [
        f"{names[0]} present",
        f"{names[2]} > 0",
    ]
    assert failed(dedup_counters({}))


def test_format_report_marks_each_check() -> None:
    text = format_report(kv_crossed_nixl([]))
    assert text.count("[FAIL]") == 3 and "[PASS]" not in text
