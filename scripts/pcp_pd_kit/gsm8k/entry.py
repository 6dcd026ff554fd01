"""The whole eval in one process: probe, expectation, task, lm-eval, manifest, verdict.

Exit codes: 0 pass, 1 score outside the expected band, 2 any error (one line on stderr).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path

from pcp_pd_kit import repo_root
from pcp_pd_kit.gsm8k import EvalError, cli, expected, finish, harness, probe
from pcp_pd_kit.gsm8k import offline_task as task_file
from pcp_pd_kit.settings import kit_env

EXIT_ERROR = 2
REPO = repo_root()
STOCK_TASK = "gsm8k"


def log(message: str) -> None:
    print(f"[eval_gsm8k] {message}", file=sys.stderr, flush=True)


def lm_eval_installed() -> bool:
    return importlib.util.find_spec("lm_eval") is not None


def output_dir(requested: str, now: datetime) -> Path:
    path = Path(requested) if requested else REPO / "results" / f"gsm8k-{now:%Y%m%dT%H%M%SZ}"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise EvalError(f"cannot create output dir {path} ({exc.strerror or exc})") from None
    return path.resolve()


def offline_task(data_dir: str, out_dir: Path) -> Path:
    """Write the offline task under ``out_dir``/tasks; return that folder (the include path)."""
    if not Path(data_dir).is_dir():
        raise EvalError(f"GSM8K_DATA_DIR={data_dir} is not a directory")
    try:
        task_file.write_task(Path(data_dir), out_dir / "tasks")
    except (OSError, ValueError) as exc:
        raise EvalError(str(exc)) from None
    return out_dir / "tasks"


def evaluate(s: cli.Settings, env: Mapping[str, str]) -> int:
    if not lm_eval_installed():
        py = sys.executable
        raise EvalError(
            f"lm-eval is not installed for {py}; install it with: "
            f"{py} -m pip install 'lm-eval[api]==0.4.13'"
        )
    log(f"proxy: {s.base_url}")
    served = probe.served_model(s.base_url, env.get("OPENAI_API_KEY", ""))
    # The expected score follows the model the server really serves, unless --model says.
    model = s.model or served
    try:
        exp = expected.resolve(model, env)
    except expected.ExpectationError as exc:
        raise EvalError(str(exc)) from None
    log(
        f"model: {model} (served as {served}); "
        f"expected strict-match {exp.score} +- {exp.tolerance} ({exp.source})"
    )

    now = datetime.now(timezone.utc)
    out = output_dir(s.output_dir, now)
    task, include_path = STOCK_TASK, None
    if s.data_dir:
        include_path = offline_task(s.data_dir, out)
        task = task_file.TASK_NAME
        # Everything is local: keep datasets/hub off the network (read when lm-eval imports them).
        os.environ.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
        log(f"offline GSM8K from {s.data_dir}")
    else:
        log("GSM8K from the Hugging Face hub (set GSM8K_DATA_DIR for a local copy)")

    log(
        f"running lm-eval ({task}, {s.limit or 'all'} questions, {s.num_fewshot}-shot, "
        f"{s.num_concurrent} concurrent)"
    )
    harness.run(
        out,
        task=task,
        include_path=include_path,
        model_args=harness.model_args(
            served, s.base_url, int(s.num_concurrent), int(s.max_gen_toks), int(s.request_timeout)
        ),
        num_fewshot=int(s.num_fewshot),
        limit=int(s.limit) if s.limit else None,
    )
    run = {
        "started": f"{now:%Y-%m-%dT%H:%M:%SZ}",
        "base_url": s.base_url,
        "model": model,
        "served_model": served,
        "task": task,
        "limit": s.limit or "all",
        "num_concurrent": s.num_concurrent,
        "num_fewshot": s.num_fewshot,
        "max_gen_toks": s.max_gen_toks,
        "request_timeout_s": s.request_timeout,
        "data_dir": s.data_dir or "hub",
    }
    servers = {"prefill": s.prefill_url, "decode": s.decode_url}
    return finish.judge(
        out, task=task, model=model, base_url=s.base_url, servers=servers, run=run, env=env
    )


def main(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    env = kit_env(os.environ) if env is None else env
    try:
        settings = cli.parse(sys.argv[1:] if argv is None else argv, env)
        if settings is None:
            print(cli.USAGE)
            return 0
        return evaluate(settings, env)
    except EvalError as exc:
        print(f"eval_gsm8k: error: {exc}", file=sys.stderr, flush=True)
        return EXIT_ERROR
