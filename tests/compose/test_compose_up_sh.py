"""scripts/compose_up.sh's diagnosis with a fake `docker` on PATH: which services it names when
`up --wait` fails, and that it cleans up. No engine needed; the live cases are in
tests/compose_live/test_bad_input.py."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest

from tests.support.paths import REPO

SCRIPT = REPO / "scripts" / "compose_up.sh"
SERVICES = ("decode-cpu", "keygen", "prefill-cpu", "prometheus", "proxy-cpu")

# States in $FAKE_DIR/states, "service state health" a line; a service without a line has no
# container. Its `logs` drains stdin, as a program that reads its input may: the script must
# give it none of its own.
FAKE_DOCKER = r"""#!/usr/bin/env bash
set -u
d="${FAKE_DIR:?}"
printf '%s\n' "$*" >>"$d/calls"
last="${!#}"
case "$1" in
  info) exit 0 ;;
  compose)
    case "$*" in
      *" version"*) echo "Docker Compose version v2.40.3" ;;
      *" up "*) exit 1 ;;
      *"config --services"*) printf '%s\n' __SERVICES__ ;;
      *"{{.ExitCode}}"*) echo "${FAKE_KEYGEN_EXIT:-0}" ;;
      *" ps "*)
        case "$last" in
          *"{{"*) cut -d' ' -f1- "$d/states" ;;
          *) grep "^$last " "$d/states" | cut -d' ' -f2- ;;
        esac ;;
      *" logs "*) cat >/dev/null; echo "log line of $last" ;;
      *" down "*) : ;;
      *) echo "fake docker: unexpected compose call: $*" >&2; exit 64 ;;
    esac ;;
  *) echo "fake docker: unexpected: $*" >&2; exit 64 ;;
esac
"""


def run_script(
    tmp_path: Path, states: str, keygen_exit: int = 0
) -> subprocess.CompletedProcess[str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    docker = bin_dir / "docker"
    docker.write_text(FAKE_DOCKER.replace("__SERVICES__", " ".join(SERVICES)))
    docker.chmod(docker.stat().st_mode | stat.S_IXUSR)
    (tmp_path / "states").write_text(states)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", FAKE_DIR=str(tmp_path))
    env.pop("KEEP_ON_FAILURE", None)
    env["FAKE_KEYGEN_EXIT"] = str(keygen_exit)
    return subprocess.run(
        ["bash", str(SCRIPT), "--profile", "cpu"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def named(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("--- ")]


@pytest.mark.parametrize("prefill", ["restarting starting", "exited", "running unhealthy"])
def test_every_server_that_is_not_healthy_is_named_with_its_logs(
    tmp_path: Path, prefill: str
) -> None:
    states = (
        "decode-cpu running starting\nkeygen exited\n"
        f"prefill-cpu {prefill}\nprometheus running healthy\nproxy-cpu created\n"
    )
    proc = run_script(tmp_path, states)
    state, _, health = prefill.partition(" ")
    assert proc.returncode == 1, proc.stderr
    assert named(proc.stderr) == [
        "--- decode-cpu (running starting), last log lines:",
        f"--- prefill-cpu ({state} {health}), last log lines:",
        "--- proxy-cpu (created ), last log lines:",
    ], proc.stderr
    for service in ("decode-cpu", "prefill-cpu", "proxy-cpu"):
        assert f"log line of {service}" in proc.stderr
    assert "removing what was started" in proc.stderr
    assert " down --remove-orphans" in (tmp_path / "calls").read_text()


def test_a_service_without_a_container_is_named_not_skipped(tmp_path: Path) -> None:
    """A `ps` that has no line for a server (a restart in flight) names it all the same."""
    states = "decode-cpu exited\nkeygen exited\nprometheus running healthy\nproxy-cpu created\n"
    proc = run_script(tmp_path, states)
    assert "--- prefill-cpu (no container ), last log lines:" in named(proc.stderr), proc.stderr
    assert "log line of prefill-cpu" in proc.stderr


def test_a_keygen_that_refused_is_named_with_its_reason(tmp_path: Path) -> None:
    """keygen exited 2 (a proxy published beyond loopback without keys): its log is the reason
    `up` stopped, so it is shown; an exit 0 keygen is its success and is skipped (above)."""
    states = "keygen exited\nprometheus running healthy\n"
    proc = run_script(tmp_path, states, keygen_exit=2)
    assert "--- keygen (exited ), last log lines:" in named(proc.stderr), proc.stderr
    assert "log line of keygen" in proc.stderr
