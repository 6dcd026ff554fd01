"""`make demo`: run a small offline GSM8K slice through the live stack, then report what it saw."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from pcp_pd_kit.localstack.live import live_checks
from pcp_pd_kit.localstack.process import signal_group
from pcp_pd_kit.localstack.report import Check
from pcp_pd_kit.localstack.stack import Stack

log = logging.getLogger("pcp_pd_kit.localstack")
DEMO_MAX_GEN_TOKS = 64
EVAL_TIMEOUT_S = 900.0


@dataclass(frozen=True)
class EvalResult:
    returncode: int
    seconds: float
    log_path: Path
    timed_out: bool = False


def gsm8k_data_dir(repo: Path) -> Path | None:
    """The GSM8K slice shipped with the kit; None if it was removed (the eval then uses the hub)."""
    candidate = repo / "scripts" / "data" / "gsm8k_slice"
    return candidate if candidate.is_dir() else None


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


def _tee(stream: IO[str], out: IO[str]) -> None:
    """Copy the eval's output to its log and the console, line by line, until EOF."""
    for line in stream:
        out.write(line)
        sys.stderr.write(f"  eval| {line}")


def _kill_group(proc: subprocess.Popen[str]) -> None:
    signal_group(proc.pid, signal.SIGKILL)  # start_new_session: group id == leader pid
    proc.wait()


def run_eval(stack: Stack, limit: int, timeout_s: float = EVAL_TIMEOUT_S) -> EvalResult:
    """Run the eval script, teeing its output to the console and run/logs/eval_gsm8k.log.

    The output is read in a thread so the timeout runs from the start: a hung lm-eval or proxy
    gets its whole process group killed after timeout_s and the result says timed_out.
    """
    repo = stack.repo
    script = repo / "scripts" / "eval_gsm8k.sh"
    log_path = stack.log_dir / "eval_gsm8k.log"
    if not script.is_file():
        log.error("%s is missing", script)
        return EvalResult(127, 0.0, log_path)
    env = {**os.environ, **eval_env(stack)}
    start = time.monotonic()
    log.info("running %s through the proxy (limit %d)", script.name, limit)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    timed_out = False
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
        reader = threading.Thread(target=_tee, args=(proc.stdout, out), daemon=True)
        reader.start()
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            log.error("%s still running after %.0fs: killing it", script.name, timeout_s)
            _kill_group(proc)
            code = proc.returncode
            timed_out = True
        except KeyboardInterrupt:
            _kill_group(proc)
            raise
        reader.join(timeout=5)
        if reader.is_alive():  # a grandchild still holds the pipe open: end the whole group
            _kill_group(proc)
            reader.join(timeout=5)
        if not reader.is_alive():
            proc.stdout.close()
        if timed_out:
            out.write(f"\n=== killed after {timeout_s:.0f}s (timeout)\n")
    return EvalResult(code, time.monotonic() - start, log_path, timed_out)


def eval_check(result: EvalResult, timeout_s: float) -> Check:
    """The eval's exit status (or its timeout) as a report check."""
    if result.timed_out:
        detail = (
            f"timed out after {timeout_s:.0f}s: killed (a hung lm-eval or proxy?); "
            f"log {result.log_path}"
        )
    else:
        detail = f"exit {result.returncode} in {result.seconds:.1f}s (log {result.log_path})"
    return Check(
        "GSM8K eval through the proxy",
        result.returncode == 0 and not result.timed_out,
        detail,
    )


def demo_checks(
    stack: Stack, limit: int, eval_timeout_s: float = EVAL_TIMEOUT_S
) -> tuple[list[Check], EvalResult]:
    """Eval through the proxy, then every live check; the eval's own exit status is a check."""
    result = run_eval(stack, limit, eval_timeout_s)
    checks = [eval_check(result, eval_timeout_s)]
    dead = [p.name for p in stack.processes.values() if not p.is_running()]
    checks.append(
        Check(
            "every stack process still running",
            not dead,
            f"exited: {', '.join(dead)} (logs in {stack.log_dir})" if dead else "all running",
        )
    )
    checks.extend(live_checks(stack.urls, stack.settings.prefill_pcp_size))
    return checks, result
