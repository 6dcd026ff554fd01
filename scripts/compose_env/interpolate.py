"""Compose-spec variable interpolation, done the way `docker compose config` does it.

Why our own: the tests must see exactly what Compose would feed the engine, on machines without a
Docker engine. Supported: ``$VAR``, ``${VAR}``, ``${VAR:-default}``, ``${VAR-default}``,
``${VAR:?err}``, ``${VAR?err}``, ``${VAR:+alt}``, ``${VAR+alt}`` and ``$$`` (a literal ``$``).
Defaults may themselves contain ``${...}``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_OPERATORS = (":-", ":?", ":+", "-", "?", "+")


class InterpolationError(ValueError):
    """A ${VAR:?err} with VAR missing, or a malformed ${...} expression."""


@dataclass(frozen=True)
class Reference:
    """One ${VAR...} use: its name and whether the expression supplies a fallback value."""

    name: str
    operator: str | None
    has_default: bool


def _find_close(text: str, start: int) -> int:
    """Index of the '}' closing the '${' whose body starts at ``start`` (braces may nest)."""
    depth = 1
    i = start
    while i < len(text):
        if text.startswith("$$", i):
            i += 2
            continue
        if text.startswith("${", i):
            depth += 1
            i += 2
            continue
        if text[i] == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    raise InterpolationError(f"unclosed '${{' in {text!r}")


def _split_body(body: str, text: str) -> tuple[str, str | None, str]:
    """Split 'NAME[op arg]' into (name, op, arg)."""
    match = _NAME.match(body)
    if not match:
        raise InterpolationError(f"invalid variable expression '${{{body}}}' in {text!r}")
    name = match.group(0)
    rest = body[match.end() :]
    if not rest:
        return name, None, ""
    for op in _OPERATORS:
        if rest.startswith(op):
            return name, op, rest[len(op) :]
    raise InterpolationError(f"invalid variable expression '${{{body}}}' in {text!r}")


def _resolve(name: str, op: str | None, arg: str, env: Mapping[str, str], text: str) -> str:
    value = env.get(name)
    unset = value is None
    empty = unset or value == ""
    if op is None:
        return value or ""
    if op in (":-", "-"):
        use_default = empty if op == ":-" else unset
        return interpolate(arg, env) if use_default else str(value)
    if op in (":?", "?"):
        missing = empty if op == ":?" else unset
        if missing:
            message = interpolate(arg, env) or "is required"
            raise InterpolationError(f"required variable {name} is missing a value: {message}")
        return str(value)
    present = not empty if op == ":+" else not unset
    return interpolate(arg, env) if present else ""


def interpolate(text: str, env: Mapping[str, str]) -> str:
    """Return ``text`` with every variable expression replaced from ``env``."""
    out: list[str] = []
    i = 0
    while i < len(text):
        char = text[i]
        if char != "$":
            out.append(char)
            i += 1
            continue
        if text.startswith("$$", i):
            out.append("$")
            i += 2
            continue
        if text.startswith("${", i):
            close = _find_close(text, i + 2)
            name, op, arg = _split_body(text[i + 2 : close], text)
            out.append(_resolve(name, op, arg, env, text))
            i = close + 1
            continue
        match = _NAME.match(text, i + 1)
        if match:
            out.append(env.get(match.group(0)) or "")
            i = match.end()
            continue
        out.append("$")
        i += 1
    return "".join(out)


def references(text: str) -> list[Reference]:
    """Every variable ``text`` reads, including those inside defaults, in order of appearance."""
    found: list[Reference] = []
    i = 0
    while i < len(text):
        if text.startswith("$$", i):
            i += 2
        elif text.startswith("${", i):
            close = _find_close(text, i + 2)
            name, op, arg = _split_body(text[i + 2 : close], text)
            found.append(Reference(name, op, has_default=op in (":-", "-")))
            found.extend(references(arg))
            i = close + 1
        elif text[i] == "$" and (match := _NAME.match(text, i + 1)):
            found.append(Reference(match.group(0), None, has_default=False))
            i = match.end()
        else:
            i += 1
    return found


def interpolate_tree(node: Any, env: Mapping[str, str]) -> Any:
    """Interpolate every string value of a parsed YAML tree (keys stay literal, as in Compose)."""
    if isinstance(node, str):
        return interpolate(node, env)
    if isinstance(node, dict):
        return {key: interpolate_tree(value, env) for key, value in node.items()}
    if isinstance(node, list):
        return [interpolate_tree(item, env) for item in node]
    return node


def tree_references(node: Any) -> list[Reference]:
    """Every variable a parsed YAML tree's string values read."""
    if isinstance(node, str):
        return references(node)
    if isinstance(node, dict):
        return [ref for value in node.values() for ref in tree_references(value)]
    if isinstance(node, list):
        return [ref for item in node for ref in tree_references(item)]
    return []
