"""The image installs only the proxy: its pins match pyproject, and the package runs standalone."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]


def test_dockerfile_pins_match_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = project["dependencies"] + [
        d for ds in project["optional-dependencies"].values() for d in ds
    ]
    pins = dict(d.split("==", 1) for d in declared if "==" in d)
    dockerfile = (ROOT / "proxy" / "Dockerfile").read_text()
    installed = dict(
        re.findall(r"\b(aiohttp|orjson|prometheus-client|uvloop)==([\w.]+)", dockerfile)
    )
    assert set(installed) == {"aiohttp", "orjson", "prometheus-client", "uvloop"}
    for name, version in installed.items():
        assert pins[name] == version, name


def test_package_copied_alone_runs(tmp_path):
    """What the Dockerfile does: copy proxy/pd_proxy somewhere and run it from PYTHONPATH."""
    shutil.copytree(
        ROOT / "proxy" / "pd_proxy",
        tmp_path / "pd_proxy",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    code = "import pd_proxy, sys; print(pd_proxy.__file__); sys.argv=['pd-proxy', '--help']; "
    code += "from pd_proxy.cli import main; main()"
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env={"PYTHONPATH": str(tmp_path), "PATH": ""},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.stdout.startswith(str(tmp_path)), proc.stdout + proc.stderr
    assert "--decode" in proc.stdout
