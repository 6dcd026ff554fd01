"""Where the repository and the stack's run directory are, independent of the caller's cwd."""

from __future__ import annotations

from pathlib import Path


def repo_root() -> Path:
    """The checkout root: the first parent of this package holding pyproject.toml."""
    here = Path(__file__).resolve()
    for parent in here.parents:
        if (parent / "pyproject.toml").is_file() and (parent / "scripts").is_dir():
            return parent
    raise RuntimeError(f"cannot find the repository root above {here}")


def run_dir(root: Path | None = None) -> Path:
    """The gitignored directory for logs, generated configs and Prometheus data."""
    return (root or repo_root()) / "run"
