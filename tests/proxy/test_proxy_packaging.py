"""The image installs only the proxy: its pins match pyproject, and the package runs standalone."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]


def _pins(lines: list[str]) -> dict[str, str]:
    out = {}
    for line in lines:
        name, sep, version = line.split("#", 1)[0].strip().partition("==")
        if sep:
            out[name.lower().replace("_", "-")] = version
    return out


def test_proxy_dependencies_are_pinned_once_and_agree_with_the_kit():
    """The image runs `pip install -c constraints.txt ./proxy`: every dependency of the proxy's own
    pyproject must be pinned there, at the version the kit's pyproject pins."""
    proxy = tomllib.loads((ROOT / "proxy" / "pyproject.toml").read_text())["project"]
    kit = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    constraints = _pins((ROOT / "constraints.txt").read_text().splitlines())
    kit_pins = _pins(
        kit["dependencies"] + [d for ds in kit["optional-dependencies"].values() for d in ds]
    )
    names = [re.split(r"[<>=\[; ]", dep, maxsplit=1)[0].lower() for dep in proxy["dependencies"]]
    assert set(names) == {
        "aiohttp",
        "jinja2",
        "msgpack",
        "opentelemetry-exporter-otlp-proto-grpc",
        "opentelemetry-exporter-otlp-proto-http",
        "opentelemetry-sdk",
        "orjson",
        "prometheus-client",
        "pyyaml",
        "pyzmq",
        "tokenizers",
        "uvloop",
    }
    assert not [d for d in proxy["dependencies"] if "==" in d], "pins live in constraints.txt"
    for name in names:
        assert constraints[name] == kit_pins[name], name


def test_proxy_builds_as_its_own_wheel(tmp_path):
    """`pip install ./proxy` (what the image does) packages pd_proxy alone, with its script."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path),
            str(ROOT / "proxy"),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    import zipfile

    (wheel,) = tmp_path.glob("pd_proxy-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names if not n.startswith("pd_proxy-")} == {"pd_proxy"}
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "pd-proxy = pd_proxy.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def test_package_copied_alone_runs(tmp_path):
    """The package needs nothing of the repository around it."""
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
