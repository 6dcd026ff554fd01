"""Shared paths and fixtures for the compose/monitoring/eval/preflight tests."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from compose_paths import ENV_EXAMPLE, REPO

for _path in (REPO / "scripts", REPO / "proxy", REPO / "connector", Path(__file__).parent):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from pd_localstack.envfile import read_env_file  # noqa: E402


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


@pytest.fixture(scope="session")
def env_example() -> dict[str, str]:
    """The knobs and their documented defaults, as Compose reads .env.example."""
    return read_env_file(ENV_EXAMPLE)
