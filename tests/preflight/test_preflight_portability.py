"""GPU hosts run preflight with their system python3, without the kit's venv: the package may
import only the standard library, and must work on Python 3.8 (Ubuntu 20.04's)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

from tests.preflight.fake_host import REPO, FakeHost, python_for

KIT = REPO / "scripts" / "pcp_pd_kit"
PACKAGE = KIT / "preflight"
PROXY = REPO / "proxy" / "pd_proxy"
CONNECTOR = REPO / "connector" / "pcp_nixl_connector"
ENTRYPOINT = REPO / "compose" / "entrypoint" / "vllm_serve"
# What `python3 -m pcp_pd_kit.preflight` loads: the kit package's __init__ and preflight itself,
# plus pd-proxy's timeout rule (check_timeouts imports it from the checkout's proxy/) and the
# connector's list of supported vLLM releases (check_vllm imports it from connector/). The vLLM
# servers' own rules (preflight/entrypoint.py imports them from compose/entrypoint/vllm_serve) are
# checked below with the rest of that package: standard library at import, Python 3.8 syntax.
SOURCES = [
    KIT / "__init__.py",
    *sorted(PACKAGE.glob("*.py")),
    PROXY / "__init__.py",
    PROXY / "timeouts.py",
    *(CONNECTOR / f"{name}.py" for name in ("__init__", "metric_names", "releases")),
]


def test_the_portability_checks_see_the_package() -> None:
    """Guards the parametrized checks below against passing vacuously on a moved package."""
    names = {p.name for p in SOURCES}
    assert {"__init__.py", "__main__.py", "cli.py", "memory.py", "settings.py"} <= names
    assert {"timeouts.py", "check_timeouts.py", "releases.py"} <= names
    assert {"gpus.py", "switches.py", "transport.py"} <= {p.name for p in ENTRYPOINT.glob("*.py")}


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: p.name)
def test_imports_only_the_standard_library(path: Path) -> None:
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots = [alias.name.split(".")[0] for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots = [node.module]
        else:
            continue
        for root in roots:
            own = root == "pcp_pd_kit" or root.startswith("pcp_pd_kit.preflight")
            own = own or root == "pd_proxy.timeouts"
            own = own or root == "pcp_nixl_connector.releases"
            own = own or root.startswith("vllm_serve.")
            assert own or root.split(".")[0] in sys.stdlib_module_names, (path.name, root)


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: p.name)
def test_syntax_is_python_3_8(path: Path) -> None:
    ast.parse(path.read_text(), feature_version=(3, 8))


def test_runs_on_the_oldest_python(host: FakeHost) -> None:
    python = python_for("3.8")
    if python is None:
        pytest.skip("no Python 3.8 interpreter here (python3.8 or pyenv 3.8.x)")
    out = host.run(python=python)
    assert out.returncode == 0, out.dump()
    assert {r["status"] for r in out.results} == {"ok"}
    host.settings.update(decode_gpu_memory_utilization="0.3", moe_backend="bogus")
    out = host.run(python=python)
    assert out.returncode == 2 and {r["check"] for r in out.fails} == {"memory", "moe-backend"}


@pytest.mark.parametrize("path", sorted(ENTRYPOINT.glob("*.py")), ids=lambda p: p.name)
def test_the_entrypoint_package_is_python_3_8_at_import(path: Path) -> None:
    """Preflight imports the vLLM containers' entrypoint package (its GPU, switch and UCX rules),
    and a module may start importing another at any time: each one's syntax must be 3.8's and
    its top-level imports the standard library or the package itself (dnspython, the connector,
    torch and nixl are imported inside the functions that run in the containers)."""
    tree = ast.parse(path.read_text(), feature_version=(3, 8))
    for node in tree.body:
        if isinstance(node, ast.Import):
            roots = [alias.name.split(".")[0] for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots = [node.module.split(".")[0]]
        else:
            continue  # a relative import: the package's own module
        for root in roots:
            own = root == "vllm_serve" and path.name == "__main__.py"
            assert own or root in sys.stdlib_module_names or root == "__future__", root
