"""Parse dotenv files and layer them: .env.example, then .env, then the process environment.

The compose stack and the local stack read the same files, so a knob set once in .env applies to
both; the process environment wins so `MODEL=... make demo` works without editing files.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from compose_env.dotenv import parse_dotenv


class EnvFileError(ValueError):
    """A line in an env file that is not KEY=VALUE."""


def parse_env_text(text: str, source: str = "<env>") -> dict[str, str]:
    """KEY=VALUE lines with Compose's rules (one parser for both stacks: compose_env.dotenv)."""
    try:
        return parse_dotenv(text)
    except ValueError as exc:
        raise EnvFileError(f"{source}: {exc}") from None


def read_env_file(path: Path) -> dict[str, str]:
    """The parsed file, or {} when it does not exist (.env is optional)."""
    if not path.is_file():
        return {}
    return parse_env_text(path.read_text(), source=str(path))


def layered_env(root: Path, environ: Mapping[str, str]) -> dict[str, str]:
    """.env.example < .env < process environment, as one flat mapping."""
    merged: dict[str, str] = {}
    merged.update(read_env_file(root / ".env.example"))
    merged.update(read_env_file(root / ".env"))
    merged.update(environ)
    return merged
