"""lm-eval in this process: ``simple_evaluate`` against the proxy, saved the way its CLI saves.

Layout under the output dir, as ``lm_eval run --output_path <dir>/lm_eval --log_samples`` wrote it:
``lm_eval/<model>/results_<date>.json`` and ``samples_<task>_<date>.jsonl``; ``lm_eval.log`` holds
everything lm-eval printed (its log lines, progress bars, warnings, and a traceback if it raised),
which also goes to stderr as it happens.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from pcp_pd_kit.gsm8k import EvalError

LOG_FORMAT = "%(asctime)s %(levelname)-8s [%(name)s:%(lineno)d] %(message)s"


def model_args(
    served_model: str, base_url: str, num_concurrent: int, max_gen_toks: int, timeout: int
) -> dict:
    """local-completions against the proxy; prompts as text, so no tokenizer is loaded.
    ``timeout``: seconds per request (lm-eval's own default is 300)."""
    return {
        "model": served_model,
        "base_url": f"{base_url.rstrip('/')}/v1/completions",
        "num_concurrent": num_concurrent,
        "max_retries": 3,
        "tokenized_requests": False,
        "tokenizer_backend": None,
        "max_gen_toks": max_gen_toks,
        "timeout": timeout,
    }


class _Tee:
    """stderr that also writes to a log file (lm-eval's tqdm bars and warnings use sys.stderr)."""

    def __init__(self, console: IO[str], log: IO[str]) -> None:
        self.console, self.log = console, log
        self.encoding = getattr(console, "encoding", "utf-8")

    def write(self, text: str) -> int:
        self.console.write(text)
        self.log.write(text)
        return len(text)

    def flush(self) -> None:
        self.console.flush()
        self.log.flush()

    def isatty(self) -> bool:
        return self.console.isatty()

    def fileno(self) -> int:
        return self.console.fileno()


@contextlib.contextmanager
def _captured(log_file: IO[str]) -> Iterator[None]:
    """stderr and the ``lm_eval`` logger (at INFO, like its CLI) to the console and the log."""
    tee = _Tee(sys.stderr, log_file)
    handler = logging.StreamHandler(tee)
    handler.setFormatter(logging.Formatter(LOG_FORMAT, datefmt="%Y-%m-%d:%H:%M:%S"))
    logger = logging.getLogger("lm_eval")
    saved = logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    try:
        with contextlib.redirect_stderr(tee):
            yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved[0])
        logger.propagate = saved[1]


def _evaluate(out_dir: Path, task: str, include_path: Path | None, **kwargs: Any) -> None:
    # Imported here: lm-eval pulls in datasets, which reads HF_*_OFFLINE when first imported.
    from lm_eval import evaluator
    from lm_eval.loggers import EvaluationTracker
    from lm_eval.tasks import TaskManager
    from lm_eval.utils import make_table

    # The offline task includes the stock gsm8k.yaml by path: no need to index every stock task.
    manager = TaskManager(include_path=include_path, include_defaults=include_path is None)
    tracker = EvaluationTracker(output_path=str(out_dir / "lm_eval"))
    results = evaluator.simple_evaluate(
        model="local-completions",
        tasks=[task],
        batch_size=1,
        log_samples=True,
        evaluation_tracker=tracker,
        task_manager=manager,
        **kwargs,
    )
    if not results:
        raise RuntimeError("simple_evaluate returned no results")
    samples = results.pop("samples")
    tracker.save_results_aggregated(results=results, samples=samples)
    for name in results["configs"]:
        tracker.save_results_samples(task_name=name, samples=samples[name])
    print(make_table(results), flush=True)  # lm-eval's own summary, on stdout as its CLI has it


def run(
    out_dir: Path,
    *,
    task: str,
    include_path: Path | None,
    model_args: dict,
    num_fewshot: int,
    limit: int | None,
) -> Path:
    """Evaluate and save under ``out_dir``; return the log. Any lm-eval failure is an EvalError
    (one line on stderr, the traceback only in the log)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # as lm-eval's CLI does
    log_path = out_dir / "lm_eval.log"
    with log_path.open("w", encoding="utf-8") as log_file, _captured(log_file):
        try:
            _evaluate(
                out_dir,
                task,
                include_path,
                model_args=model_args,
                num_fewshot=num_fewshot,
                limit=limit,
            )
        except Exception as exc:  # lm-eval may raise anything: report it in one line
            traceback.print_exc(file=log_file)
            raise EvalError(
                f"lm-eval failed: {type(exc).__name__}: {exc} (log: {log_path})"
            ) from None
    return log_path
