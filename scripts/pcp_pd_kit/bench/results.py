"""One results layout for every bench kind, and the one Markdown table printer.

Each run of `pcp-pd-kit bench KIND` writes ``results/<kind>-<UTC time>/`` holding
``result.json`` (the measurements), ``table.md`` (what was printed) and ``manifest.json`` (what
ran, on what, with which versions). Kinds may add files beside them (vllm bench serve's own
per-level JSON, server logs), never other names for these three.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pcp_pd_kit import repo_root
from pcp_pd_kit.bench import manifest as manifest_mod

RESULT_FILE = "result.json"
TABLE_FILE = "table.md"
MANIFEST_FILE = "manifest.json"


@dataclass(frozen=True)
class Outcome:
    """What one bench kind measured: JSON-ready data, its Markdown table, manifest additions
    (knobs, topology) and the exit status (non-zero when a check of the run failed)."""

    result: Any
    table: str
    manifest: Mapping[str, Any] = field(default_factory=dict)
    rc: int = 0


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub Markdown table; every row must have one cell per header."""
    for row in rows:
        if len(row) != len(headers):
            raise ValueError(f"row {list(row)!r} has {len(row)} cells for {len(headers)} headers")
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def run_dir(kind: str, results_dir: str | Path | None, started_utc: str) -> Path:
    """``<results_dir or <repo>/results>/<kind>-<started_utc>``, created; an existing one is an
    error (two runs never share a folder)."""
    root = Path(results_dir) if results_dir else repo_root() / "results"
    out = root / f"{kind}-{started_utc}"
    out.mkdir(parents=True, exist_ok=False)
    return out


def write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def base_manifest(kind: str, started_utc: str, argv: Sequence[str] | None = None) -> dict[str, Any]:
    """What every kind records: the kind, its command line (keys redacted), git, host, versions."""
    command = (
        list(argv) if argv is not None else [sys.executable, "-m", "pcp_pd_kit", *sys.argv[1:]]
    )
    return {
        "kind": kind,
        "started_utc": started_utc,
        "command": manifest_mod.redact_argv(command),
        "git": manifest_mod.git_info(repo_root()),
        "versions": manifest_mod.package_versions(),
        "host": manifest_mod.host_info(),
        "load_average": manifest_mod.load_average(),
    }


def write_run(
    out: Path,
    result: Any,
    table: str,
    manifest: Mapping[str, Any],
) -> None:
    """The three files of the layout; the table is also what the caller prints."""
    write_json(out / RESULT_FILE, result)
    (out / TABLE_FILE).write_text(table.rstrip("\n") + "\n")
    write_json(out / MANIFEST_FILE, dict(manifest))
