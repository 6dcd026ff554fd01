"""Fake commands for scripts under test: a file on a test's own PATH that the script runs."""

from __future__ import annotations

import stat
from pathlib import Path


def write_executable(path: Path, text: str) -> None:
    """``text`` (a script with its shebang) at ``path``, executable by its owner."""
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
