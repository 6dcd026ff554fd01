"""KV_TRANSPORT_CHECK at start (compose's GPU servers): one NIXL READ between two processes on the
replica's first GPU with the server's own UCX settings (nixl_read_probe.py, beside this module),
judged before the first request: warn (the default), refuse, or off.

A probe that could not run is "not checked", never a verdict: a server is refused only on what
UCX showed. Standard library only at import.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from .console import log
from .ucx_tables import ProtoScanner

CHECK_ENV = "KIT_KV_TRANSPORT_CHECK"
CHECK_MODES = ("warn", "refuse", "off")
HOST_DETECTED = "detected as host"
PROBE_TIMEOUT_S = 180.0
PROBE_ARGS = ("--device", "cuda", "--mib", "64", "--iters", "3")


def check_mode(raw: str | None) -> str:
    """KV_TRANSPORT_CHECK: warn (default), refuse or off; ValueError otherwise."""
    mode = (raw or "warn").strip().lower()
    if mode not in CHECK_MODES:
        raise ValueError(f"{CHECK_ENV}={raw!r} (KV_TRANSPORT_CHECK): want one of {CHECK_MODES}")
    return mode


@dataclass
class ProbeVerdict:
    """What a NIXL READ at start showed. ``problem``: the pull would not be GPU to GPU (the
    server should warn or refuse); ``unknown``: the probe itself failed, so nothing is known."""

    summary: str
    problem: str | None = None
    unknown: bool = False


def probe_verdict(returncode: int, stdout: str, stderr: str, ucx_log: str) -> ProbeVerdict:
    """Judge nixl_read_probe.py's run: its exit, its JSON line, NIXL's errors and UCX's tables."""
    if HOST_DETECTED in stderr:
        return ProbeVerdict(
            "GPU memory could not be registered",
            "UCX sees GPU memory as host memory (the wrong nixl build's UCX modules loaded?)",
        )
    scanner = ProtoScanner()
    tables = [t for line in ucx_log.splitlines() for t in scanner.feed(line)]
    pulls = [t for t in [*tables, *scanner.close()] if t.is_remote_read()]
    result: dict[str, object] = {}
    for line in reversed(stdout.strip().splitlines()):
        if line.startswith("{"):
            try:
                result = json.loads(line)
            except ValueError:
                pass
            break
    if returncode != 0 or not result:
        last = (stderr.strip().splitlines() or ["no output"])[-1]
        return ProbeVerdict(f"the probe failed (exit {returncode}): {last[:300]}", unknown=True)
    rate = result.get("gb_per_s")
    speed = f"{rate:.1f} GB/s" if isinstance(rate, (int, float)) else "speed unknown"
    if not pulls:
        return ProbeVerdict(
            f"{speed}; UCX printed no pull table (UCX_PROTO_INFO off?)", unknown=True
        )
    for pull in pulls:
        problem = pull.problem_on_gpu()
        if problem:
            return ProbeVerdict(f"{pull.summary()}, {speed}", problem)
    return ProbeVerdict(f"{pulls[-1].summary()}, {speed}")


def probe_kv_transport(env: Mapping[str, str]) -> ProbeVerdict:
    """One NIXL READ between two processes on this replica's first GPU with the server's own UCX
    settings (nixl_read_probe.py beside this module), judged by probe_verdict(): what UCX will
    choose for the KV pull, known before the first request."""
    probe = Path(__file__).resolve().with_name("nixl_read_probe.py")
    with tempfile.TemporaryDirectory(prefix="kit-kv-probe-") as tmp:
        ucx_log = Path(tmp) / "ucx.txt"
        cmd = [sys.executable, str(probe), *PROBE_ARGS, "--log", str(ucx_log)]
        try:
            proc = subprocess.run(
                cmd,
                env={**env, "UCX_PROTO_INFO": "y"},
                capture_output=True,
                text=True,
                timeout=PROBE_TIMEOUT_S,
            )
        except subprocess.TimeoutExpired:
            return ProbeVerdict(f"the probe did not finish in {PROBE_TIMEOUT_S:.0f}s", unknown=True)
        text = ucx_log.read_text(errors="replace") if ucx_log.exists() else ""
        return probe_verdict(proc.returncode, proc.stdout, proc.stderr, text)


def check_kv_transport(
    env: Mapping[str, str],
    mode: str,
    probe: Callable[[Mapping[str, str]], ProbeVerdict] = probe_kv_transport,
) -> str | None:
    """KV_TRANSPORT_CHECK at start (GPU servers): probe, log the verdict loudly when the pull
    would not be GPU to GPU, and return the reason to refuse (mode ``refuse``) or None."""
    if mode == "off":
        return None
    verdict = probe(env)
    if verdict.problem:
        log(
            f"KV TRANSPORT WARNING: at start, a NIXL READ with this server's UCX settings: "
            f"{verdict.problem} [{verdict.summary}] (docs/gpu.md, 'KV transport')"
        )
        if mode == "refuse":
            return f"KV_TRANSPORT_CHECK=refuse: {verdict.problem}"
    elif verdict.unknown:
        log(f"KV transport not checked at start: {verdict.summary}")
    else:
        log(f"KV pull transport at start: {verdict.summary}")
    return None
