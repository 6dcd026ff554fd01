"""Fixtures for the preflight tests: the kit_preflight package importable for unit tests, and a
fake GPU host (fake docker / nvidia-smi / ip in tmp_path) for the command-line tests."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

_HERE = Path(__file__).resolve().parent
for _path in (_HERE.parents[1] / "scripts", _HERE):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from preflight_fakes import FakeHost  # noqa: E402


@pytest.fixture
def host(tmp_path: Path) -> FakeHost:
    """A healthy 3 x H100 host: Compose 2.29, NVIDIA runtime, model cached, image pulled."""
    return FakeHost(tmp_path)
