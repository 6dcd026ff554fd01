"""Fixtures for the preflight tests: a fake GPU host (fake docker / nvidia-smi / ip in tmp_path)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.preflight.fake_host import FakeHost


@pytest.fixture
def host(tmp_path: Path) -> FakeHost:
    """A healthy 3 x H100 host: Compose 2.29, NVIDIA runtime, model cached, image pulled."""
    return FakeHost(tmp_path)
