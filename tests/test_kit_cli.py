"""`pcp-pd-kit`, the kit's one command line: every user-facing job is reachable through it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pcp_pd_kit.cli import main
from pcp_pd_kit.gsm8k import cli as eval_cli


def test_console_script_is_installed_and_lists_every_job() -> None:
    script = Path(sys.executable).parent / "pcp-pd-kit"
    assert script.is_file(), "make install (pip install -e .) creates the console script"
    out = subprocess.run(
        [str(script), "--help"], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    for job in ("up", "demo", "bench", "eval", "preflight"):
        assert f"\n    {job} " in out or f"\n    {job}\n" in out, (job, out)


def test_eval_flags_pass_through_untouched(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["eval", "--help"]) == 0
    assert capsys.readouterr().out.strip() == eval_cli.USAGE.strip()
    assert main(["eval", "--limit", "0"]) == 2
    assert "--limit must be a positive integer" in capsys.readouterr().err


def test_preflight_flags_pass_through_untouched(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["preflight", "--help"])
    assert exc.value.code == 0
    assert "usage: scripts/preflight.sh" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        main(["preflight", "--no-such-flag"])
    assert exc.value.code == 100


@pytest.mark.parametrize("argv", [[], ["serve"], ["demo", "--limit", "x"]])
def test_bad_command_lines_are_usage_errors(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert "usage: pcp-pd-kit" in capsys.readouterr().err
