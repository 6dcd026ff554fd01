"""compose/entrypoint/vllm_serve/nixl_read_probe.py, run for real on this CPU machine: two
processes, two NIXL agents, one READ over UCX's tcp, the data checked. The H200 captures in data/
came from the same script with --device cuda; here it proves the script still runs, and that what
it prints (its JSON line, UCX's tables) is what the entrypoint's start check reads."""

from __future__ import annotations

import json
import subprocess
import sys

from vllm_serve import transport_check, ucx_tables

from tests.entrypoint.probe_run import PROBE, ProbeRun


def test_a_cpu_read_is_checked_and_its_table_is_the_one_the_scanner_reads(
    cpu_probe: ProbeRun,
) -> None:
    assert cpu_probe.returncode == 0, cpu_probe.stderr[-3000:]
    out = json.loads(cpu_probe.stdout.strip().splitlines()[-1])
    assert out["checksum_ok"] is True and out["error"] == ""
    assert out["gb_per_s"] > 0 and out["ucx_env"]["UCX_PROTO_INFO"] == "y"
    scanner = ucx_tables.ProtoScanner()
    lines = cpu_probe.ucx_log.splitlines()
    found = [t for line in lines for t in scanner.feed(line)] + list(scanner.close())
    (pull,) = [t for t in found if t.is_remote_read()]
    assert "probe-initiator" in pull.heading and "into host memory" in pull.heading
    assert pull.transports() == {"tcp"}
    assert "host memory" in (pull.problem_on_gpu() or "")  # on a GPU host this is the alarm
    # The side read from keeps its own tables.
    assert cpu_probe.log_path.with_name("ucx.txt.target").exists()


def test_the_start_checks_verdict_on_the_probes_real_output(cpu_probe: ProbeRun) -> None:
    """probe_verdict() on exactly what the probe printed and UCX wrote: the speed comes from the
    probe's own JSON line, the problem from UCX's own table (host memory: on a GPU host, UCX
    without its CUDA module). A change to either format fails here, not on a GPU host."""
    assert cpu_probe.returncode == 0, cpu_probe.stderr[-3000:]
    rate = json.loads(cpu_probe.stdout.strip().splitlines()[-1])["gb_per_s"]
    verdict = transport_check.probe_verdict(
        cpu_probe.returncode, cpu_probe.stdout, cpu_probe.stderr, cpu_probe.ucx_log
    )
    assert not verdict.unknown, verdict
    assert verdict.problem is not None and "host memory" in verdict.problem
    assert verdict.summary.endswith(f"tcp/lo, {rate:.1f} GB/s"), verdict.summary
    assert "probe-initiator intra-node" in verdict.summary


def test_bad_sizes_are_refused() -> None:
    res = subprocess.run(
        [sys.executable, str(PROBE), "--log", "/dev/null", "--mib", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2 and "--mib and --iters must be positive" in res.stderr
