"""`make demo`: run the demo's eval through the live stack, then report what it saw.

The eval is scripts/eval_gsm8k.sh (lm-eval's GSM8K task on local JSONL files); demo_task decides
which questions and how they are judged; scores compares the P/D run with the single instance's.
"""

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

from pcp_pd_kit.localstack.demo_task import DemoTask, gsm8k_task
from pcp_pd_kit.localstack.keys import EVAL_KEY_VARIABLE
from pcp_pd_kit.localstack.live import live_checks
from pcp_pd_kit.localstack.process import signal_group
from pcp_pd_kit.localstack.report import Check
from pcp_pd_kit.localstack.stack import Stack

log = logging.getLogger("pcp_pd_kit.localstack")
EVAL_TIMEOUT_S = 900.0


@dataclass(frozen=True)
class EvalResult:
    returncode: int
    seconds: float
    log_path: Path
    timed_out: bool = False
    out_dir: Path | None = None  # where the eval wrote results.json and the samples


def eval_command(
    stack: Stack, limit: int, task: DemoTask, target: str = "proxy", out_dir: Path | None = None
) -> list[str]:
    """scripts/eval_gsm8k.sh against ``target``: the proxy, or the single-instance reference."""
    urls = stack.urls
    url = urls[target]
    argv = [
        "bash",
        str(stack.repo / "scripts" / "eval_gsm8k.sh"),
        "--base-url",
        url,
        "--limit",
        str(limit),
        "--num-concurrent",
        "4",
        "--max-gen-toks",
        str(task.max_gen_toks),
        "--output-dir",
        str(out_dir or stack.work_dir / "eval-gsm8k"),
        # The manifest's topology: the P/D pair, or the one server that did both.
        "--prefill-url",
        urls.get("prefill", url),
        "--decode-url",
        urls.get("decode", url),
    ]
    if task.data_dir is not None:
        argv += ["--data-dir", str(task.data_dir)]
    if task.num_fewshot is not None:
        argv += ["--num-fewshot", str(task.num_fewshot)]
    return argv


def _tee(stream: IO[str], out: IO[str]) -> None:
    """Copy the eval's output to its log and the console, line by line, until EOF."""
    for line in stream:
        out.write(line)
        sys.stderr.write(f"  eval| {line}")


def _kill_group(proc: subprocess.Popen[str]) -> None:
    signal_group(proc.pid, signal.SIGKILL)  # start_new_session: group id == leader pid
    proc.wait()


def run_eval(
    stack: Stack,
    limit: int,
    timeout_s: float = EVAL_TIMEOUT_S,
    task: DemoTask | None = None,
    target: str = "proxy",
) -> EvalResult:
    """Run the eval script, teeing its output to the console and run/logs/eval_gsm8k[-T].log.

    The output is read in a thread so the timeout runs from the start: a hung lm-eval or proxy
    gets its whole process group killed after timeout_s and the result says timed_out.
    """
    repo = stack.repo
    task = task or gsm8k_task(stack.settings, repo)
    script = repo / "scripts" / "eval_gsm8k.sh"
    suffix = "" if target == "proxy" else f"-{target}"
    log_path = stack.log_dir / f"eval_gsm8k{suffix}.log"
    out_dir = stack.work_dir / f"eval-gsm8k{suffix}"
    if not script.is_file():
        log.error("%s is missing", script)
        return EvalResult(127, 0.0, log_path)
    env = {**os.environ, **task.eval_env}
    if target == "proxy" and stack.client_key is not None:
        env[EVAL_KEY_VARIABLE] = stack.client_key  # the proxy wants a key; the reference none
    start = time.monotonic()
    log.info("running %s on %s against the %s (limit %d)", script.name, task.label, target, limit)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    timed_out = False
    with open(log_path, "w") as out:
        proc = subprocess.Popen(
            eval_command(stack, limit, task, target, out_dir),
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
    return EvalResult(code, time.monotonic() - start, log_path, timed_out, out_dir)


def eval_check(
    result: EvalResult, timeout_s: float, name: str = "GSM8K eval through the proxy"
) -> Check:
    """The eval's exit status (or its timeout) as a report check."""
    if result.timed_out:
        detail = (
            f"timed out after {timeout_s:.0f}s: killed (a hung lm-eval or proxy?); "
            f"log {result.log_path}"
        )
    else:
        detail = f"exit {result.returncode} in {result.seconds:.1f}s (log {result.log_path})"
    return Check(
        name,
        result.returncode == 0 and not result.timed_out,
        detail,
    )


def demo_checks(
    stack: Stack,
    limit: int,
    eval_timeout_s: float = EVAL_TIMEOUT_S,
    task: DemoTask | None = None,
) -> tuple[list[Check], EvalResult]:
    """Eval through the proxy, then every live check; the eval's own exit status is a check."""
    task = task or gsm8k_task(stack.settings, stack.repo)
    result = run_eval(stack, limit, eval_timeout_s, task)
    checks = [eval_check(result, eval_timeout_s, f"{task.label} through the proxy (P/D)")]
    dead = [p.name for p in stack.processes.values() if not p.is_running()]
    checks.append(
        Check(
            "every stack process still running",
            not dead,
            f"exited: {', '.join(dead)} (logs in {stack.log_dir})" if dead else "all running",
        )
    )
    checks.extend(
        live_checks(stack.urls, stack.settings.prefill_pcp_size, proxy_headers=stack.proxy_headers)
    )
    return checks, result
