"""`make demo`: run a small offline GSM8K slice through the live stack, then report what it saw."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from pd_localstack.live import live_checks
from pd_localstack.report import Check
from pd_localstack.stack import Stack

log = logging.getLogger("pd_localstack")
DEMO_MAX_GEN_TOKS = 64


@dataclass(frozen=True)
class EvalResult:
    returncode: int
    seconds: float
    log_path: Path


def gsm8k_data_dir(repo: Path) -> Path | None:
    """The slice shipped with the kit, else the shared full copy; None when neither exists."""
    for candidate in (
        repo / "scripts" / "data" / "gsm8k_slice",
        repo.parent / "shared" / "data" / "gsm8k",
    ):
        if candidate.is_dir():
            return candidate
    return None


def eval_command(stack: Stack, limit: int, data_dir: Path | None) -> list[str]:
    """scripts/eval_gsm8k.sh against the proxy; short generations keep the demo to a minute."""
    urls = stack.urls
    argv = [
        "bash",
        str(stack.repo / "scripts" / "eval_gsm8k.sh"),
        "--base-url",
        urls["proxy"],
        "--limit",
        str(limit),
        "--num-concurrent",
        "4",
        "--max-gen-toks",
        str(DEMO_MAX_GEN_TOKS),
        "--output-dir",
        str(stack.work_dir / "eval-gsm8k"),
        "--prefill-url",
        urls["prefill"],
        "--decode-url",
        urls["decode"],
    ]
    if data_dir is not None:
        argv += ["--data-dir", str(data_dir)]
    return argv


def eval_env(stack: Stack) -> dict[str, str]:
    """The expected score: a random-weights model scores 0, so the band check still runs.

    With a real MODEL, set DEMO_EXPECTED_SCORE to its known GSM8K strict-match score.
    """
    return {"EXPECTED_SCORE": stack.settings.demo_expected_score}


def run_eval(stack: Stack, limit: int, timeout_s: float = 900.0) -> EvalResult:
    """Run the eval script, teeing its output to the console and run/logs/eval_gsm8k.log."""
    repo = stack.repo
    script = repo / "scripts" / "eval_gsm8k.sh"
    log_path = stack.log_dir / "eval_gsm8k.log"
    if not script.is_file():
        log.error("%s is missing", script)
        return EvalResult(127, 0.0, log_path)
    env = {**os.environ, **eval_env(stack)}
    start = time.monotonic()
    log.info("running %s through the proxy (limit %d)", script.name, limit)
    with open(log_path, "w") as out:
        proc = subprocess.Popen(
            eval_command(stack, limit, gsm8k_data_dir(repo)),
            env=env,
            cwd=repo,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        assert proc.stdout is not None
        try:
            for line in proc.stdout:
                out.write(line)
                sys.stderr.write(f"  eval| {line}")
            code = proc.wait(timeout=timeout_s)
        except (subprocess.TimeoutExpired, KeyboardInterrupt):
            os.killpg(proc.pid, 9)
            proc.wait()
            raise
    return EvalResult(code, time.monotonic() - start, log_path)


def demo_checks(stack: Stack, limit: int) -> tuple[list[Check], EvalResult]:
    """Eval through the proxy, then every live check; the eval's own exit status is a check."""
    result = run_eval(stack, limit)
    checks = [
        Check(
            "GSM8K eval through the proxy",
            result.returncode == 0,
            f"exit {result.returncode} in {result.seconds:.1f}s (log {result.log_path})",
        )
    ]
    dead = [p.name for p in stack.processes.values() if not p.is_running()]
    checks.append(
        Check(
            "every stack process still running",
            not dead,
            f"exited: {', '.join(dead)} (logs in {stack.log_dir})" if dead else "all running",
        )
    )
    checks.extend(live_checks(stack.urls, stack.repo))
    return checks, result
