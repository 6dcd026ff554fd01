"""Fixtures for the compose tests: the checkout and its documented defaults."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.env import example_env
from tests.support.paths import REPO


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


@pytest.fixture(scope="session")
def env_example() -> dict[str, str]:
    """The knobs and their documented defaults, as Compose reads .env.example."""
    return example_env()
