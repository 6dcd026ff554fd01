"""Runs host commands (docker, nvidia-smi, ip) with a time limit, so a hung daemon or driver
becomes a FAIL line instead of a hung preflight."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Outcome:
    """How a command ended. `returncode` is None when it could not start or ran out of time."""

    argv: tuple[str, ...]
    returncode: int | None
    stdout: str
    stderr: str
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    @property
    def missing(self) -> bool:
        """The command does not exist (or is not executable)."""
        return self.returncode is None and not self.timed_out

    def detail(self, limit: int = 200) -> str:
        """The last non-empty line of stderr (else stdout): what a FAIL line quotes."""
        if self.timed_out:
            return "timed out"
        for text in (self.stderr, self.stdout):
            lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
            if lines:
                line = lines[-1]
                return line if len(line) <= limit else line[: limit - 3] + "..."
        return f"exit status {self.returncode}"


def run(argv: Sequence[str], timeout: float) -> Outcome:
    """Run `argv` without a shell; after `timeout` seconds kill its whole process group."""
    args = tuple(argv)
    try:
        proc = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # its own group, so a timeout also stops its children
        )
    except OSError as exc:  # not found, not executable
        return Outcome(args, None, "", str(exc))
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out, err = proc.communicate()
        return Outcome(args, None, _text(out), _text(err), timed_out=True)
    return Outcome(args, proc.returncode, _text(out), _text(err))


def _text(data: bytes | None) -> str:
    return (data or b"").decode("utf-8", errors="replace")
