"""Repository paths for the compose tests (a uniquely named module: test folders share sys.path,
so `from conftest import ...` would pick whichever conftest was imported first)."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SHARED = REPO.parent / "shared"
COMPOSE_DIR = REPO / "compose"
COMPOSE_FILES = sorted(COMPOSE_DIR.glob("docker-compose*.yml"))
