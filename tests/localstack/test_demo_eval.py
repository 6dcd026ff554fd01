"""run_eval's timeout runs from the start, even while the eval holds its output open."""

from pathlib import Path

from pcp_pd_kit.localstack.demo import eval_check, run_eval
from pcp_pd_kit.localstack.stack import Stack
from tests.support.env import example_settings


def _stack_with_eval_script(tmp_path: Path, body: str) -> Stack:
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    (repo / "scripts" / "eval_gsm8k.sh").write_text(f"#!/usr/bin/env bash\n{body}\n")
    return Stack(example_settings(), repo=repo, work_dir=tmp_path / "run")


def test_hung_eval_is_killed_and_reported_as_a_failed_check(tmp_path: Path) -> None:
    # A background sleep keeps stdout open too: reading to EOF would block for 20 s.
    stack = _stack_with_eval_script(tmp_path, "echo eval started\nsleep 20 &\nsleep 20")
    result = run_eval(stack, limit=1, timeout_s=1.0)
    assert result.timed_out
    check = eval_check(result, 1.0)
    assert not check.ok
    assert "timed out after 1s" in check.detail and str(result.log_path) in check.detail
    assert "eval started" in result.log_path.read_text()


def test_eval_exit_status_is_the_check(tmp_path: Path) -> None:
    stack = _stack_with_eval_script(tmp_path, "echo scored; exit 3")
    result = run_eval(stack, limit=1, timeout_s=60.0)
    assert (result.returncode, result.timed_out) == (3, False)
    check = eval_check(result, 60.0)
    assert not check.ok and check.detail.startswith("exit 3 in ")
    assert "scored" in result.log_path.read_text()
    ok = run_eval(_stack_with_eval_script(tmp_path / "ok", "exit 0"), limit=1, timeout_s=60.0)
    assert eval_check(ok, 60.0).ok
