"""The files deploy/k8s carries for kustomize (generated/ folders) are the sources' bytes: one copy
of the truth (connector/, compose/entrypoint, compose/grafana, compose/prometheus), checked here
and refreshed by `make k8s-sources`."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.k8s.manifests import DEPLOY
from tests.support.paths import REPO

SCRIPT = DEPLOY / "sources.py"


def load(path: Path = SCRIPT) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"k8s_sources_{id(path)}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_generated_copies_are_in_sync_with_their_sources() -> None:
    assert load().problems() == [], "run `make k8s-sources` and commit the result"


def test_check_mode_exits_0_when_in_sync() -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--check"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr


def test_make_target_runs_the_generator() -> None:
    makefile = (REPO / "Makefile").read_text()
    assert "k8s-sources:" in makefile and "deploy/k8s/sources.py" in makefile


@pytest.fixture
def copy_of_the_tree(tmp_path: Path) -> tuple[ModuleType, Path]:
    """The generator pointed at a copy of the repository parts it reads and writes."""
    root = tmp_path / "repo"
    for part in ("connector/pcp_nixl_connector", "compose", "deploy/k8s"):
        shutil.copytree(REPO / part, root / part, ignore=shutil.ignore_patterns("__pycache__"))
    module = load(root / "deploy/k8s/sources.py")
    return module, root


def test_drift_is_reported_and_fixed(copy_of_the_tree) -> None:
    sources, root = copy_of_the_tree
    sources.write()  # start in sync, whatever state the working tree is in
    assert sources.problems() == []
    pkg = root / "connector/pcp_nixl_connector"
    (pkg / "stats.py").write_text((pkg / "stats.py").read_text() + "\n# changed\n")
    (pkg / "sub").mkdir()
    (pkg / "sub" / "new_module.py").write_text("X = 1\n")
    entry = root / "compose/entrypoint/vllm_serve"
    (entry / "main.py").unlink()
    (entry / "main.py").write_text("# other\n")
    (entry / "new_step.py").write_text("X = 1\n")
    (root / "deploy/k8s/base/generated/connector/gone.py").write_text("")
    found = sources.problems()
    assert "deploy/k8s/base/generated/connector/stats.py differs from its source" in found
    assert "deploy/k8s/base/generated/connector/sub/new_module.py is missing" in found
    assert "deploy/k8s/base/generated/entrypoint/main.py differs from its source" in found
    assert "deploy/k8s/base/generated/entrypoint/new_step.py is missing" in found
    assert "deploy/k8s/base/generated/connector/gone.py has no source any more" in found
    assert "deploy/k8s/base/generated/kustomization.yaml differs from its source" in found
    assert "deploy/k8s/base/generated/connector-volume.yaml differs from its source" in found
    sources.write()
    assert sources.problems() == []
    kustomization = (root / "deploy/k8s/base/generated/kustomization.yaml").read_text()
    assert "sub.new_module.py=connector/sub/new_module.py" in kustomization
    assert "      - entrypoint/new_step.py\n" in kustomization  # the package's new module ships
    volume = (root / "deploy/k8s/base/generated/connector-volume.yaml").read_text()
    assert "key: sub.new_module.py\n                path: sub/new_module.py" in volume
    assert not (root / "deploy/k8s/base/generated/connector/gone.py").exists()
