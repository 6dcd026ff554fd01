"""The demo's accuracy checks: each run's strict-match, and P/D equal to the single instance.

Read back from what lm-eval saved (results.json and its per-question samples), so the report
states what was scored, not what the eval printed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pcp_pd_kit.gsm8k import results
from pcp_pd_kit.localstack.report import Check


@dataclass(frozen=True)
class Score:
    value: float
    samples: int
    answers: dict[int, str]  # doc id -> the strict-match extraction lm-eval scored


def read_score(out_dir: Path) -> Score:
    """The strict-match score and per-question answers of one eval run under ``out_dir``."""
    data = results.load(out_dir / "results.json")
    task = next(iter(data["results"]))
    value, _, samples = results.strict_match(data, task)
    answers: dict[int, str] = {}
    for path in sorted(out_dir.rglob(f"samples_{task}_*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            row = json.loads(line)
            if row.get("filter") == "strict-match":
                answers[int(row["doc_id"])] = str(row["filtered_resps"])
    return Score(value, samples or len(answers), answers)


def score_line(name: str, score: Score | None) -> str:
    if score is None:
        return f"strict-match {name}: no score"
    return f"strict-match {name}: {score.value:.4f} on {score.samples} held-out samples"


def score_checks(
    pd: Score | None, single: Score | None, min_score: float | None, min_samples: int = 1
) -> list[Check]:
    """Each run at least min_score on at least min_samples, and P/D equal to single instance."""
    checks: list[Check] = []
    for name, score in (("P/D", pd), ("single instance", single)):
        ok = score is not None and score.samples >= min_samples
        if min_score is not None:
            ok = ok and score is not None and score.value >= min_score
        floor = f" (needs >= {min_score:.2f})" if min_score is not None else ""
        checks.append(Check(f"strict-match {name}", ok, score_line(name, score) + floor))
    if pd is None or single is None:
        checks.append(Check("P/D equals single instance", False, "a run left no score"))
        return checks
    differing = answer_differences(pd, single)
    checks.append(
        Check(
            "P/D equals single instance",
            pd.value == single.value and pd.samples == single.samples and not differing,
            f"{pd.value:.4f} vs {single.value:.4f}; "
            f"{len(single.answers) - len(differing)}/{len(single.answers)} answers identical"
            + (f"; differ on doc ids {_ids(differing)}" if differing else ""),
        )
    )
    return checks


def answer_differences(pd: Score, single: Score) -> list[int]:
    """The questions (doc ids) whose strict-match answer through P/D is not the single instance's,
    a question one run answered and the other did not included: greedy P/D must change no answer,
    and equal scores can hide two answers that moved in opposite directions."""
    return sorted(
        doc
        for doc in single.answers.keys() | pd.answers.keys()
        if pd.answers.get(doc) != single.answers.get(doc)
    )


def _ids(docs: list[int], shown: int = 10) -> str:
    head = ", ".join(map(str, docs[:shown]))
    return head + (f" and {len(docs) - shown} more" if len(docs) > shown else "")
