"""Parse dotenv files and layer them: .env.example, then .env, then the process environment.

The compose stack and the local stack read the same files, so a knob set once in .env applies to
both; the process environment wins so `MODEL=... make demo` works without editing files.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class EnvFileError(ValueError):
    """A line in an env file that is not KEY=VALUE."""


def parse_env_text(text: str, source: str = "<env>") -> dict[str, str]:
    """KEY=VALUE lines; blank lines and '#' comments skipped; optional 'export '; quotes stripped.

    An unquoted value ends at ' #' (an inline comment), as in docker compose's parser.
    """
    values: dict[str, str] = {}
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("export "):
            line = line[len("export ") :].lstrip()
        key, sep, value = line.partition("=")
        key = key.strip()
        if not sep or not _KEY.match(key):
            raise EnvFileError(f"{source}:{lineno}: expected KEY=VALUE, got {raw!r}")
        values[key] = _unquote(value.strip(), f"{source}:{lineno}")
    return values


def _unquote(value: str, where: str) -> str:
    if value[:1] in ("'", '"'):
        quote = value[0]
        end = value.find(quote, 1)
        if end == -1:
            raise EnvFileError(f"{where}: unterminated {quote} quote")
        return value[1:end]
    comment = value.find(" #")
    return value[:comment].rstrip() if comment != -1 else value


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
