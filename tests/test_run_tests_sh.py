"""scripts/run_tests.sh (what `make test` and CI run), against stand-ins for the engine, the image
build and the venv's tools: the exit status is the suite's (a clean-clone run once exited 2 on a
green suite: the EXIT trap's own failed `kill` became the script's status), the engine is stopped
whatever happens, and the live suites wait for the images and are skipped when they fail."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.support.paths import REPO

STUB = """#!/usr/bin/env bash
echo "$(basename "$0") $*" >> "{calls}"
{body}
"""


def _sandbox(tmp_path: Path, images_rc: int = 0, pytest_rc: str = "0 0") -> Path:
    root = tmp_path / "repo"
    (root / "scripts").mkdir(parents=True)
    (root / ".venv" / "bin").mkdir(parents=True)
    shutil.copy(REPO / "scripts" / "run_tests.sh", root / "scripts" / "run_tests.sh")
    calls = tmp_path / "calls"
    unit_rc, live_rc = pytest_rc.split()
    stubs = {
        "scripts/docker_engine.sh": "exit 0",
        "scripts/images.sh": f"echo '[images] built'; sleep 1; exit {images_rc}",
        ".venv/bin/lint-imports": "exit 0",  # the import layers (make lint)
        ".venv/bin/python": (
            'case "$*" in *"not e2e"*) exit '
            + unit_rc
            + ';; *"e2e or compose"*) exit '
            + live_rc
            + ";; esac; exit 0"
        ),
    }
    for rel, body in stubs.items():
        path = root / rel
        path.write_text(STUB.format(calls=calls, body=body))
        path.chmod(0o755)
    return root


def _run(root: Path) -> tuple[int, list[str], str]:
    proc = subprocess.run(
        ["bash", str(root / "scripts" / "run_tests.sh")],
        capture_output=True, text=True, timeout=60, cwd=root,
    )  # fmt: skip
    calls = (root.parent / "calls").read_text().splitlines()
    return proc.returncode, calls, proc.stderr


@pytest.mark.parametrize(
    ("images_rc", "pytest_rc", "want_rc", "live_runs"),
    [(0, "0 0", 0, True), (0, "1 0", 1, True), (0, "0 1", 1, True), (1, "0 0", 1, False)],
)
def test_status_engine_stop_and_the_live_suites(
    tmp_path: Path, images_rc: int, pytest_rc: str, want_rc: int, live_runs: bool
) -> None:
    rc, calls, err = _run(_sandbox(tmp_path, images_rc, pytest_rc))
    assert rc == want_rc, err
    assert calls[0] == "docker_engine.sh ensure" and calls[-1] == "docker_engine.sh stop", calls
    assert any("images.sh" in c for c in calls)
    assert any("not e2e and not compose" in c for c in calls)
    assert any("e2e or compose" in c for c in calls) == live_runs, calls
    if not live_runs:
        assert "the images did not build" in err
