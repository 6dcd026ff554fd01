"""The demo's accuracy checks: each run's floor, P/D equal to the single instance, read back
from what lm-eval saved."""

import json
from pathlib import Path

from pcp_pd_kit.localstack.scores import (
    Score,
    answer_differences,
    read_score,
    score_checks,
)


def _score(value: float, answers: list[str]) -> Score:
    return Score(value, len(answers), dict(enumerate(answers)))


def _by_name(checks: list) -> dict[str, bool]:
    return {c.name: c.ok for c in checks}


def test_equal_scores_above_the_floor_pass() -> None:
    pd, single = _score(0.9, ["1", "2"]), _score(0.9, ["1", "2"])
    checks = score_checks(pd, single, 0.8)
    assert all(c.ok for c in checks)
    assert "2/2 answers identical" in checks[-1].detail


def test_a_score_below_the_floor_fails_even_when_equal() -> None:
    checks = _by_name(score_checks(_score(0.7, ["1"]), _score(0.7, ["1"]), 0.8))
    assert checks == {
        "strict-match P/D": False,
        "strict-match single instance": False,
        "P/D equals single instance": True,
    }


def test_pd_differing_from_single_instance_fails() -> None:
    checks = score_checks(_score(0.9, ["1", "2"]), _score(0.85, ["1", "3"]), 0.8)
    assert _by_name(checks)["P/D equals single instance"] is False
    assert "1/2 answers identical" in checks[-1].detail


def test_equal_scores_with_different_answers_fail_and_name_the_questions() -> None:
    # Two answers that moved in opposite directions leave the score and sample count equal.
    pd, single = _score(0.5, ["1", "x", "3", "4"]), _score(0.5, ["1", "2", "y", "4"])
    checks = score_checks(pd, single, 0.4)
    assert _by_name(checks)["P/D equals single instance"] is False
    assert "2/4 answers identical; differ on doc ids 1, 2" in checks[-1].detail


def test_a_question_answered_by_one_run_only_is_a_difference() -> None:
    single = _score(1.0, ["1", "2"])
    pd = Score(1.0, 2, {0: "1", 1: "2", 2: "3"})
    assert answer_differences(pd, single) == [2]
    assert answer_differences(single, single) == []


def test_a_missing_run_fails_and_too_few_samples_fail() -> None:
    assert not all(c.ok for c in score_checks(None, _score(1.0, ["1"]), 0.8))
    few = score_checks(_score(1.0, ["1"]), _score(1.0, ["1"]), 0.8, min_samples=50)
    assert not _by_name(few)["strict-match P/D"]


def test_read_score_from_lm_eval_output(tmp_path: Path) -> None:
    task = "gsm8k_offline"
    results = {
        "results": {task: {"exact_match,strict-match": 0.5}},
        "n-samples": {task: {"effective": 2}},
    }
    (tmp_path / "results.json").write_text(json.dumps(results))
    nested = tmp_path / "lm_eval" / "model"
    nested.mkdir(parents=True)
    rows = [
        {"doc_id": 0, "filter": "strict-match", "filtered_resps": ["9"]},
        {"doc_id": 0, "filter": "flexible-extract", "filtered_resps": ["13"]},
        {"doc_id": 1, "filter": "strict-match", "filtered_resps": ["[invalid]"]},
    ]
    (nested / f"samples_{task}_2026.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    score = read_score(tmp_path)
    assert (score.value, score.samples) == (0.5, 2)
    assert score.answers == {0: "['9']", 1: "['[invalid]']"}
