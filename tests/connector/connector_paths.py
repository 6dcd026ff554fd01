"""Repository paths for the connector tests (uniquely named; see tests/compose/compose_paths.py)."""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
CONNECTOR_DIR = REPO_ROOT / "connector"
