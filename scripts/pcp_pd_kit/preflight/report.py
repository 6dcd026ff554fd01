"""One result per line, `ok|WARN|FAIL  <sentence naming the fix>`, or the same list as JSON, and
the exit status (the number of FAILs, capped at 100) that scripts and `make` act on."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass

OK = "ok"
WARN = "WARN"
FAIL = "FAIL"
MAX_EXIT = 100


@dataclass(frozen=True)
class Result:
    """What one check found: `check` names it (stable, for --json), `message` is one sentence."""

    check: str
    status: str
    message: str


def ok(check: str, message: str) -> Result:
    return Result(check, OK, message)


def warn(check: str, message: str) -> Result:
    return Result(check, WARN, message)


def fail(check: str, message: str) -> Result:
    return Result(check, FAIL, message)


def failures(results: Iterable[Result]) -> int:
    return sum(1 for r in results if r.status == FAIL)


def exit_status(results: Iterable[Result]) -> int:
    """Number of FAILs capped at 100, so the shell status never wraps around 256."""
    return min(failures(results), MAX_EXIT)


def render_text(results: list[Result], next_step: str) -> str:
    """The result lines, then what to do next: fix the FAILs, or `next_step` when none failed."""
    lines = [f"{r.status:<4}  {r.message}" for r in results]
    count = failures(results)
    if count:
        lines += [
            "",
            f"{count} check(s) failed: fix the lines marked FAIL, then run "
            "scripts/preflight.sh again.",
        ]
    else:
        lines += ["", f"all checks passed: {next_step}"]
    return "\n".join(lines) + "\n"


def render_json(results: list[Result]) -> str:
    return json.dumps([asdict(r) for r in results], indent=2) + "\n"
