"""scripts/bootstrap.sh's build tools for pd-proxy's C part, sourced with fake `apt-get`, `id`,
`sudo` and Python on a PATH without a C compiler: what it installs, how it gets root, and the clear
error where it cannot. Nothing is installed and nothing of the repository is written."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.fake_bin import write_executable
from tests.support.paths import REPO

SCRIPT = REPO / "scripts" / "bootstrap.sh"
FAKE_PYTHON = """#!/bin/bash
case "$*" in
  *Python.h*) exit __HEADERS__ ;;
  *version_info*) echo python3.11-dev ;;
esac
"""
RECORD = '#!/bin/bash\nprintf "%s %s\\n" "$(basename "$0")" "$*" >>"$FAKE_DIR/calls"\n'
SUDO = RECORD + 'exec "$@"\n'


@dataclass
class Host:
    bin: Path
    calls: Path

    def run(self) -> subprocess.CompletedProcess[str]:
        probe = f'source "{SCRIPT}"; install_build_tools; echo done'
        env = {"PATH": str(self.bin), "FAKE_DIR": str(self.calls.parent)}
        env["PYTHON"] = str(self.bin / "python")
        return subprocess.run(
            ["/bin/bash", "-c", probe], env=env, capture_output=True, text=True, timeout=60
        )

    def called(self) -> list[str]:
        return self.calls.read_text().splitlines() if self.calls.exists() else []


def host(tmp_path: Path, *, uid: int, cc: bool, headers: bool, apt: bool, sudo: bool) -> Host:
    fake = tmp_path / "bin"
    fake.mkdir()
    for tool in ("dirname", "basename"):  # what sourcing and the fakes use, nothing more
        found = shutil.which(tool)
        assert found is not None
        (fake / tool).symlink_to(found)
    write_executable(fake / "id", f"#!/bin/bash\necho {uid}\n")
    write_executable(fake / "python", FAKE_PYTHON.replace("__HEADERS__", "0" if headers else "1"))
    if cc:
        write_executable(fake / "cc", "#!/bin/bash\n")
    if apt:
        write_executable(fake / "apt-get", RECORD)
    if sudo:
        write_executable(fake / "sudo", SUDO)
    return Host(fake, tmp_path / "calls")


def test_as_root_without_a_compiler_or_headers_it_installs_both(tmp_path: Path) -> None:
    h = host(tmp_path, uid=0, cc=False, headers=False, apt=True, sudo=False)
    res = h.run()
    assert res.returncode == 0 and res.stdout.strip() == "done", res.stdout + res.stderr
    assert h.called() == [
        "apt-get update -qq",
        "apt-get install -y -qq --no-install-recommends gcc libc6-dev python3.11-dev",
    ]


def test_as_a_user_it_goes_through_sudo_for_what_is_missing(tmp_path: Path) -> None:
    h = host(tmp_path, uid=1000, cc=True, headers=False, apt=True, sudo=True)
    res = h.run()
    assert res.returncode == 0, res.stdout + res.stderr
    assert h.called() == [
        "sudo apt-get update -qq",
        "apt-get update -qq",
        "sudo apt-get install -y -qq --no-install-recommends python3.11-dev",
        "apt-get install -y -qq --no-install-recommends python3.11-dev",
    ]


def test_with_a_compiler_and_headers_it_installs_nothing(tmp_path: Path) -> None:
    h = host(tmp_path, uid=1000, cc=True, headers=True, apt=True, sudo=True)
    res = h.run()
    assert res.returncode == 0 and res.stdout.strip() == "done", res.stdout + res.stderr
    assert h.called() == []


@pytest.mark.parametrize(
    ("uid", "apt", "sudo", "says"),
    [
        (0, False, False, "apt-get is not available: install gcc libc6-dev"),
        (1000, True, False, "this user is not root: run 'sudo apt-get update -qq'"),
    ],
)
def test_where_it_cannot_install_it_says_what_to_do(
    tmp_path: Path, uid: int, apt: bool, sudo: bool, says: str
) -> None:
    h = host(tmp_path, uid=uid, cc=False, headers=True, apt=apt, sudo=sudo)
    res = h.run()
    assert res.returncode == 1 and "done" not in res.stdout, res.stdout + res.stderr
    assert says in res.stderr and h.called() == []
