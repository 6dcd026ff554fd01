"""The decisions inside pcp-pd-kit eval: offline task == lm-eval's gsm8k, expectations,
parsing."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import yaml

from pcp_pd_kit.gsm8k import expected, manifest, offline_task, results, topology
from tests.support.env import example_env

DATASET_KEYS = {"task", "tag", "dataset_path", "dataset_name", "dataset_kwargs"}


def stock_gsm8k() -> dict:
    spec = importlib.util.find_spec("lm_eval")
    assert spec is not None and spec.submodule_search_locations
    root = Path(next(iter(spec.submodule_search_locations)))
    return yaml.safe_load((root / "tasks" / "gsm8k" / "gsm8k.yaml").read_text())


def test_offline_task_matches_stock_gsm8k_except_the_dataset(tmp_path) -> None:
    from lm_eval.tasks._yaml_loader import load_yaml

    for split in ("train", "test"):
        (tmp_path / f"{split}.jsonl").write_text('{"question": "q", "answer": "a #### 1"}\n')
    # The task file as lm-eval reads it: its include of the stock gsm8k.yaml resolved.
    ours = load_yaml(offline_task.write_task(tmp_path, tmp_path / "tasks"), resolve_func=False)
    stock = stock_gsm8k()
    assert {k: v for k, v in ours.items() if k not in DATASET_KEYS} == {
        k: v for k, v in stock.items() if k not in DATASET_KEYS
    }
    assert ours["dataset_path"] == "json"
    assert set(ours["dataset_kwargs"]["data_files"]) == {"train", "test"}


def test_offline_task_rejects_rows_without_fields(tmp_path) -> None:
    (tmp_path / "train.jsonl").write_text('{"question": "q", "answer": "1"}\n')
    (tmp_path / "test.jsonl").write_text('{"prompt": "q"}\n')
    with pytest.raises(ValueError, match="'question' and 'answer'"):
        offline_task.check_data_dir(tmp_path)


@pytest.mark.parametrize(
    "model",
    [
        "deepseek-ai/DeepSeek-V2-Lite-Chat",
        "/models/DeepSeek-V2-Lite-Chat/",
        "deepseek-v2-lite-chat",
    ],
)
def test_builtin_expectation(model: str) -> None:
    exp = expected.resolve(model, {})
    assert (exp.score, exp.tolerance, exp.source) == (0.65, 0.05, "built-in table")
    assert exp.accepts(0.6535) and exp.accepts(0.6001) and exp.accepts(0.6999)
    assert not exp.accepts(0.59) and not exp.accepts(0.71)


@pytest.mark.parametrize(
    ("expected_score", "tolerance", "measured", "accepted"),
    [
        (0.65, 0.05, 0.60, False),  # the edges fail, as in vLLM's `measured - RTOL < expected`
        (0.65, 0.05, 0.70, False),
        (0.65, 0.05, 120 / 200, False),  # --limit 200: 120 right is the lower edge exactly
        (0.65, 0.05, 121 / 200, True),
        (0.65, 0.05, 139 / 200, True),
        (0.65, 0.05, 140 / 200, False),
        (0.65, 0.05, 0.6 + 1e-6, True),
        (0.65, 0.05, 0.7 - 1e-6, True),
        (0.5, 0.1, 0.4, False),
        (0.0, 0.0, 0.0, True),  # an empty band asks for the score exactly
        (0.0, 0.0, 0.01, False),
    ],
)
def test_tolerance_is_strict_at_both_edges(expected_score, tolerance, measured, accepted) -> None:
    exp = expected.Expectation(expected_score, tolerance, "test")
    assert exp.accepts(measured) is accepted
    assert manifest.verdict(measured, exp)["passed"] is accepted


def test_manifest_records_the_setting_set() -> None:
    """The eval's layered env names the set the GPU servers ran with: .env.example's defaults are
    not the reference run's; the documented reference set is, however its numbers are spelled."""
    env_example = example_env()
    defaults = manifest.setting_set(env_example)
    assert defaults["name"] == "custom"
    assert set(defaults["differs_from_reference"]) == set(manifest.REFERENCE_SETTINGS)
    assert defaults["knobs"]["MOE_BACKEND"] == env_example["MOE_BACKEND"]
    reference = {
        **env_example,
        **manifest.REFERENCE_SETTINGS,
        "PREFILL_GPU_MEMORY_UTILIZATION": "0.30",
    }
    assert manifest.setting_set(reference)["name"] == "reference"
    assert manifest.setting_set(reference)["differs_from_reference"] == []
    eager_only = {**reference, "MOE_BACKEND": "auto"}
    assert manifest.setting_set(eager_only)["differs_from_reference"] == ["MOE_BACKEND"]
    doc = manifest.build(
        run={},
        score=0.65,
        stderr=None,
        samples=1,
        expectation=expected.Expectation(0.65, 0.05, "test"),
        topology={},
        env=reference,
        results_file="r.json",
    )
    assert doc["settings"]["name"] == "reference"
    assert doc["env"]["ENFORCE_EAGER"] == "1" and doc["env"]["MOE_BACKEND"] == "flashinfer_cutlass"
    assert doc["verdict"]["accepted_range_bounds"] == "exclusive"


def test_reference_settings_are_knobs_of_env_example() -> None:
    assert set(manifest.REFERENCE_SETTINGS) <= set(example_env())


def test_env_overrides_and_errors() -> None:
    exp = expected.resolve("x/tiny", {"EXPECTED_SCORE": "0", "SCORE_TOLERANCE": "0.01"})
    assert (exp.score, exp.tolerance, exp.source) == (0.0, 0.01, "EXPECTED_SCORE")
    with pytest.raises(expected.ExpectationError, match="set EXPECTED_SCORE"):
        expected.resolve("x/tiny", {})
    with pytest.raises(expected.ExpectationError, match="not a number"):
        expected.resolve("x/tiny", {"EXPECTED_SCORE": "high"})
    with pytest.raises(expected.ExpectationError, match="between 0 and 1"):
        expected.resolve("x/tiny", {"EXPECTED_SCORE": "65"})


def test_strict_match_reads_lm_eval_results() -> None:
    doc = {
        "results": {
            "gsm8k": {"exact_match,strict-match": 0.6535, "exact_match_stderr,strict-match": 0.013}
        },
        "n-samples": {"gsm8k": {"original": 1319, "effective": 1319}},
    }
    assert results.strict_match(doc, "gsm8k") == (0.6535, 0.013, 1319)
    with pytest.raises(results.ResultsError, match="gsm8k_offline"):
        results.strict_match(doc, "gsm8k_offline")


def test_find_results_file_errors_when_empty(tmp_path) -> None:
    with pytest.raises(results.ResultsError, match="no results_"):
        results.find_results_file(tmp_path)


def test_parse_metrics_and_summary() -> None:
    text = (
        "# HELP x\n# TYPE vllm:cache_config_info gauge\n"
        'vllm:cache_config_info{block_size="128",engine="0"} 1.0\n'
        'vllm:prompt_tokens_by_source_total{engine="0",model_name="m",'
        'source="external_kv_transfer"} 5\n'
        'vllm:prompt_tokens_by_source_total{engine="1",model_name="m",'
        'source="external_kv_transfer"} 7\n'
        'vllm:nixl_num_failed_transfers_total{engine="0",model_name="m"} 0\n'
        "garbage line\n"
    )
    summary = topology.summarize_metrics(text)
    assert summary["cache_config"] == {"block_size": "128", "engine": "0"}
    assert summary["counters"] == {
        'vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}': 12.0,
        "vllm:nixl_num_failed_transfers_total": 0.0,
    }


def test_probe_server_records_errors_instead_of_raising() -> None:
    from tests.support import net

    (port,) = net.free_ports(1)
    info = topology.probe_server(f"http://127.0.0.1:{port}", timeout=1)
    assert set(info["errors"]) == {"/version", "/v1/models", "/metrics"}
