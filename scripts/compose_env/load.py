"""Read a compose file and the .env files the way Compose would, for checks without Docker."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from compose_env.dotenv import parse_dotenv
from compose_env.interpolate import interpolate_tree


def load_env_file(path: Path) -> dict[str, str]:
    """Parse one .env file; the error names the file."""
    try:
        return parse_dotenv(path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from exc


def load_raw(path: Path) -> dict[str, Any]:
    """The compose file as YAML (anchors and << merges resolved), before interpolation."""
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a YAML mapping")
    return data


def load_compose(path: Path, env: Mapping[str, str]) -> dict[str, Any]:
    """The compose file after interpolation with ``env``."""
    return interpolate_tree(load_raw(path), env)
