"""The checkout's paths, from one place (the tests run from any cwd)."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
COMPOSE_DIR = REPO / "compose"
COMPOSE_FILE = REPO / "compose.yaml"
DEBUG_PORTS_FILE = COMPOSE_DIR / "debug-ports.yaml"
ENV_EXAMPLE = REPO / ".env.example"
CONNECTOR_DIR = REPO / "connector"
SCRIPTS_DIR = REPO / "scripts"
DOCS_DIR = REPO / "docs"
