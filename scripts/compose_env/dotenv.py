"""Parse a Compose-style .env file (KEY=VALUE lines) into a dict.

Why not python-dotenv: one more dependency for ~30 lines, and Compose's own rules matter here
(unquoted values end at ' #', double quotes take escapes, single quotes are literal).
"""

from __future__ import annotations

import re

_LINE = re.compile(r"^(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)\s*=\s*(.*)$")
_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", '"': '"', "\\": "\\", "$": "$"}


def _double_quoted(raw: str, lineno: int) -> str:
    out: list[str] = []
    i = 1
    while i < len(raw):
        char = raw[i]
        if char == "\\" and i + 1 < len(raw):
            nxt = raw[i + 1]
            out.append(_ESCAPES.get(nxt, "\\" + nxt))
            i += 2
            continue
        if char == '"':
            return "".join(out)
        out.append(char)
        i += 1
    raise ValueError(f"line {lineno}: unterminated double quote")


def _value(raw: str, lineno: int) -> str:
    if raw.startswith('"'):
        return _double_quoted(raw, lineno)
    if raw.startswith("'"):
        end = raw.find("'", 1)
        if end < 0:
            raise ValueError(f"line {lineno}: unterminated single quote")
        return raw[1:end]
    comment = re.search(r"\s#", raw)
    return (raw[: comment.start()] if comment else raw).strip()


def parse_dotenv(text: str) -> dict[str, str]:
    """Return the variables ``text`` sets; a malformed line raises ValueError with its number."""
    env: dict[str, str] = {}
    for lineno, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        match = _LINE.match(stripped)
        if not match:
            raise ValueError(f"line {lineno}: expected KEY=VALUE, got {stripped!r}")
        env[match.group(1)] = _value(match.group(2), lineno)
    return env
