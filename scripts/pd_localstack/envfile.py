"""The kit's one reader of env files: python-dotenv's parser, strict about malformed lines.

Files are layered .env.example, then .env, then the process environment, so a knob set once in
.env applies to compose (which reads .env itself) and the local stack alike, and `MODEL=... make
demo` works without editing files. python-dotenv only warns about a line it cannot parse; a kit
setting silently dropped is worse than a clear error, so every such line is an error here.
"""

from __future__ import annotations

import io
import re
from collections.abc import Mapping
from pathlib import Path

from dotenv.parser import parse_stream

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class EnvFileError(ValueError):
    """A line in an env file that is not KEY=VALUE."""


def parse_env_text(text: str, source: str = "<env>") -> dict[str, str]:
    """KEY=VALUE lines (comments, `export`, quotes as Compose reads them); no interpolation."""
    values: dict[str, str] = {}
    for binding in parse_stream(io.StringIO(text)):
        if binding.key is None and not binding.error:
            continue  # blank line or comment
        line = binding.original.line
        stripped = binding.original.string.strip()
        if binding.error or binding.value is None or not _NAME.fullmatch(binding.key or ""):
            raise EnvFileError(f"{source}: line {line}: expected KEY=VALUE, got {stripped!r}")
        values[binding.key] = binding.value
    return values


def read_env_file(path: Path) -> dict[str, str]:
    """The parsed file, or {} when it does not exist (.env is optional)."""
    if not path.is_file():
        return {}
    return parse_env_text(path.read_text(encoding="utf-8"), source=str(path))


def layered_env(root: Path, environ: Mapping[str, str]) -> dict[str, str]:
    """.env.example < .env < process environment, as one flat mapping."""
    merged: dict[str, str] = {}
    merged.update(read_env_file(root / ".env.example"))
    merged.update(read_env_file(root / ".env"))
    merged.update(environ)
    return merged
