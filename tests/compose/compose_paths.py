"""Repository paths for the compose tests (a uniquely named module: test folders share sys.path,
so `from conftest import ...` would pick whichever conftest was imported first)."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
COMPOSE_DIR = REPO / "compose"
COMPOSE_FILE = REPO / "compose.yaml"
DEBUG_PORTS_FILE = COMPOSE_DIR / "debug-ports.yaml"
ENV_EXAMPLE = REPO / ".env.example"
