"""pcp-pd-kit's own tooling: one package, one command line (`pcp-pd-kit`, `python -m pcp_pd_kit`).

localstack: the embedded CPU P/D stack (up, demo); bench: vLLM's serving benchmark, single vs P/D;
gsm8k: the accuracy eval through the proxy; preflight: GPU host checks before `docker compose up`.
The connector (`pcp_nixl_connector`) and the proxy (`pd_proxy`) are packages of their own because
they ship into the vLLM and proxy images. Standard library only at this level: preflight runs with
a GPU host's system python3.
"""

from __future__ import annotations

from pathlib import Path


def repo_root() -> Path:
    """The checkout this package runs from: the first parent holding pyproject.toml and scripts/."""
    here = Path(__file__).resolve()
    for parent in here.parents:
        if (parent / "pyproject.toml").is_file() and (parent / "scripts").is_dir():
            return parent
    raise RuntimeError(f"cannot find the repository root above {here}")
