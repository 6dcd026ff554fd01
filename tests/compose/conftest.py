"""Shared paths and fixtures for the compose/monitoring/eval/preflight tests."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from compose_paths import COMPOSE_DIR, COMPOSE_FILES, REPO, SHARED  # noqa: F401

for _path in (REPO / "scripts", REPO / "proxy", REPO / "connector", Path(__file__).parent):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from compose_env.load import load_env_file  # noqa: E402


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


@pytest.fixture(scope="session")
def env_example() -> dict[str, str]:
    return load_env_file(REPO / ".env.example")
