"""What `make demo` evaluates: the trained model on held-out arithmetic, or a MODEL on GSM8K.

With MODEL empty the demo builds the kit's trained tiny model and scores it on held-out
GSM8K-format questions it never trained on, through P/D and on a single instance: an accuracy
that can fail, where the random model's GSM8K score is 0 by construction. With a MODEL of your
own it runs the shipped GSM8K slice against DEMO_EXPECTED_SCORE, as before.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from pcp_pd_kit.settings import StackSettings

# The floor each run must reach on the held-out questions (and P/D must equal single instance).
MIN_SCORE = 0.80
MIN_SAMPLES = 50
# The eval's own band must never be the stricter check: strictly inside (0.79, 1.0].
_BAND = {"EXPECTED_SCORE": "1.0", "SCORE_TOLERANCE": "0.21"}
# A held-out answer is at most about 20 tokens and an EOS; GSM8K's are much longer.
ARITH_MAX_GEN_TOKS = 48
GSM8K_MAX_GEN_TOKS = 64


@dataclass(frozen=True)
class DemoTask:
    """The eval the demo runs twice (P/D, then a single instance) and how it is judged."""

    label: str
    data_dir: Path | None  # GSM8K-format JSONL (test + train); None: the eval's hub default
    max_gen_toks: int
    num_fewshot: int | None = None  # None: the eval's NUM_FEWSHOT
    eval_env: dict[str, str] = field(default_factory=dict)
    min_score: float | None = None  # None: the eval's band (DEMO_EXPECTED_SCORE) decides
    # Questions to score; None: DEMO_LIMIT / --limit. The held-out task scores all of its own:
    # the accuracy it reports is over the whole held-out set, never a slice of it.
    limit: int | None = None
    min_samples: int = 1  # fewer scored questions and a run's score says too little


def gsm8k_data_dir(repo: Path) -> Path | None:
    """The GSM8K slice shipped with the kit; None if it was removed (the eval then uses the hub)."""
    candidate = repo / "scripts" / "data" / "gsm8k_slice"
    return candidate if candidate.is_dir() else None


def arithmetic_task(model_dir: Path) -> DemoTask:
    """Zero-shot, as the model was trained: lm-eval's GSM8K prompt, scoring and stop strings."""
    from pcp_pd_kit.arith import build

    data_dir = build.task_dir(model_dir)
    questions = (data_dir / "test.jsonl").read_text(encoding="utf-8").splitlines()
    return DemoTask(
        label="held-out arithmetic (GSM8K format)",
        data_dir=data_dir,
        max_gen_toks=ARITH_MAX_GEN_TOKS,
        num_fewshot=0,
        eval_env=dict(_BAND),
        min_score=MIN_SCORE,
        limit=len(questions),
        min_samples=MIN_SAMPLES,
    )


def gsm8k_task(settings: StackSettings, repo: Path) -> DemoTask:
    return DemoTask(
        label="GSM8K slice",
        data_dir=gsm8k_data_dir(repo),
        max_gen_toks=GSM8K_MAX_GEN_TOKS,
        eval_env={"EXPECTED_SCORE": settings.demo_expected_score},
    )


def choose(settings: StackSettings, repo: Path) -> tuple[StackSettings, DemoTask]:
    """Empty MODEL: build (or keep) the trained model and serve it; else the user's on GSM8K."""
    if settings.model:
        return settings, gsm8k_task(settings, repo)
    from pcp_pd_kit.arith import build

    model_dir = build.build(repo / build.DEFAULT_DIR)
    chosen = dataclasses.replace(
        settings,
        model=str(model_dir),
        served_model_name=settings.served_model_name or build.SERVED_NAME,
    )
    return chosen, arithmetic_task(model_dir)
