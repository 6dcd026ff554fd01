"""The KV transport on a GPU host (compose/entrypoint/vllm_serve: transport.py, ucx_tables.py,
transport_check.py): the nixl CUDA build's UCX modules picked to match torch, and UCX's protocol
tables read as vLLM runs. Every table is UCX's real output (nixl 1.5.1's UCX) for a NIXL READ
between two agents by the entrypoint's nixl_read_probe.py: over tcp/lo on a CPU machine, and
between two processes on one H200 (torch 2.11+cu130, nixl_cu13) with cuda_ipc GET zero-copy forced
(`y`, what compose sets) and left at UCX's `auto`, captured by hand in one session (docs/gpu.md,
"Measured on an H200"). The probe's JSON line the verdict reads is this machine's real one
(tests/entrypoint/conftest.py), not a line typed to look like the H200's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from vllm_serve import supervise, transport, transport_check, ucx_tables

from tests.entrypoint import ENTRYPOINT_DIR
from tests.entrypoint.probe_run import ProbeRun

DATA = Path(__file__).with_name("data")
CPU_CAPTURE = (DATA / "ucx_proto_info_cpu_tcp.txt").read_text()
PULL_HOST = "remote memory read by ucp_get*(multi) into host memory from host"
H200_ZCOPY_Y = (DATA / "ucx_proto_info_h200_get_zcopy_y.txt").read_text()
H200_ZCOPY_AUTO = (DATA / "ucx_proto_info_h200_get_zcopy_auto.txt").read_text()
PULL_GPU = "remote memory read by ucp_get*(multi) into cuda/GPU0 from cuda/dev[1]"


PRINT_FILE = "import sys; sys.stdout.write(open(sys.argv[1]).read())"


def tables(text: str) -> list:
    scanner = ucx_tables.ProtoScanner()
    found = [t for line in text.splitlines(keepends=True) for t in scanner.feed(line)]
    return [t for t in [*found, *scanner.close()] if t.is_remote_read()]


def test_the_real_cpu_capture_has_one_kv_pull_over_tcp() -> None:
    (pull,) = tables(CPU_CAPTURE)
    assert pull.title == ["a intra-node cfg#1", PULL_HOST]
    assert pull.rows == [("0..inf", "software emulation", "tcp/lo")]
    assert pull.transports() == {"tcp"}
    # On a GPU host host memory means UCX lacks its CUDA module (the wrong nixl build loaded).
    assert "host memory" in pull.problem_on_gpu()


def test_the_h200_pull_with_get_zcopy_auto_is_flagged_as_tcp() -> None:
    """UCX's default on a GPU without active NVLink: the pull ran at 0.56 GB/s on the H200."""
    (pull,) = tables(H200_ZCOPY_AUTO)
    assert pull.title == ["probe-initiator intra-node cfg#2", PULL_GPU]
    assert pull.rows == [("0..inf", "software emulation", "tcp/lo")]
    assert pull.problem_on_gpu() == "the KV pull runs over TCP only (software emulation)"


def test_the_h200_pull_with_get_zcopy_forced_is_cuda_ipc() -> None:
    """compose's UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y: the same pull ran at 1,105 GB/s."""
    (pull,) = tables(H200_ZCOPY_Y)
    assert pull.title[1] == PULL_GPU
    assert pull.rows == [("0..inf", "zero-copy", "cuda_ipc/cuda")]
    assert pull.transports() == {"cuda_ipc"} and pull.problem_on_gpu() is None


def test_self_and_active_message_tables_are_not_the_pull() -> None:
    scanner = ucx_tables.ProtoScanner()
    every = [t for line in CPU_CAPTURE.splitlines() for t in scanner.feed(line)]
    assert len(every) >= 4 and sum(t.is_remote_read() for t in every) == 1


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("cuda: Optional[str] = '12.8'\n", 12),
        ("__version__ = '2.9.0+cu130'\ncuda = '13.0'\n", 13),
        ("cuda: Optional[str] = None\n", None),
    ],
)
def test_torch_cuda_major(tmp_path, text, want) -> None:
    (tmp_path / "version.py").write_text(text)
    assert transport.torch_cuda_major(tmp_path) == want


def test_nixls_builds_in_this_venv_each_carry_the_cuda_module() -> None:
    """The installed nixl 1.5.1: both CUDA builds, each with its own UCX modules folder."""
    site, _ = transport.install_paths()
    for major in (12, 13):
        folder = transport.nixl_ucx_dir(site, major)
        assert folder == site / f"nixl_cu{major}.libs" / "ucx"


def test_a_build_without_the_cuda_module_is_refused(tmp_path) -> None:
    (tmp_path / "nixl_cu12.libs" / "ucx").mkdir(parents=True)
    (tmp_path / "nixl_cu12.libs" / "ucx" / "libuct_ib.so.0").write_text("")
    with pytest.raises(ValueError, match="has no libuct_cuda.so"):
        transport.nixl_ucx_dir(tmp_path, 12)
    with pytest.raises(ValueError, match="no .*nixl_cu13.libs/ucx for torch's CUDA 13"):
        transport.nixl_ucx_dir(tmp_path, 13)


def test_gpu_env_pins_the_matching_build_and_warns_about_auto(tmp_path) -> None:
    site, _ = transport.install_paths()
    torch_dir = tmp_path / "torch"
    torch_dir.mkdir()
    (torch_dir / "version.py").write_text("cuda: Optional[str] = '13.0'\n")
    env = {"UCX_TLS": "cuda_ipc,cuda_copy,tcp,sm,self", "UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y"}
    extra, warnings = transport.gpu_ucx_env(env, site, torch_dir)
    assert extra == {"UCX_MODULE_DIR": str(site / "nixl_cu13.libs" / "ucx")} and warnings == []
    _, warnings = transport.gpu_ucx_env({"UCX_TLS": "tcp,self"}, site, torch_dir)
    assert len(warnings) == 2 and "(unset: auto)" in warnings[0] and "no cuda_ipc" in warnings[1]
    cpu_torch = Path(transport.install_paths()[1])  # this machine's torch is a CPU build
    with pytest.raises(ValueError, match="CPU build"):
        transport.gpu_ucx_env(env, site, cpu_torch)


def test_supervise_relays_vllms_stdout_and_the_watch_sees_ucx_tables(tmp_path) -> None:
    """A stand-in vLLM (a real process) prints UCX's table: our stdout gets it unchanged, the
    entrypoint's watcher flags the TCP pull."""
    capture = tmp_path / "ucx.txt"
    capture.write_text(H200_ZCOPY_AUTO)
    runner = (
        "import sys\n"
        f"sys.path.insert(0, {str(ENTRYPOINT_DIR)!r})\n"
        "from vllm_serve.supervise import supervise\n"
        "from vllm_serve.ucx_tables import ProtoScanner\n"
        "seen = []\n"
        "scanner = ProtoScanner()\n"
        "def watch(line):\n"
        "    for t in scanner.feed(line):\n"
        "        if t.is_remote_read(): seen.append(t.problem_on_gpu())\n"
        f"cmd = [sys.executable, '-c', {PRINT_FILE!r}, {str(capture)!r}]\n"
        # No wait here: supervise() returns only once the relay has passed on the last line.
        "code = supervise(cmd, {}, interfaces=frozenset, poll_s=0.1, watch=watch)\n"
        "print('SEEN', seen, file=sys.stderr)\n"
    )
    res = subprocess.run([sys.executable, "-c", runner], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout == H200_ZCOPY_AUTO  # relayed byte for byte
    assert "SEEN ['the KV pull runs over TCP only (software emulation)']" in res.stderr


def test_supervise_returns_after_the_relay_passed_on_vllms_last_lines(monkeypatch) -> None:
    """vLLM's last lines (a crash's traceback, UCX's last table) reach the log before the
    container exits, even when the watcher is slower than vLLM's exit; and a worker left holding
    the pipe delays the exit by the bound alone."""
    monkeypatch.setattr(supervise.signal, "signal", lambda *args: None)  # keep pytest's handlers
    watched: list[str] = []

    def slow_watch(line: str) -> None:
        time.sleep(0.3)
        watched.append(line.strip())

    printer = "print('one'); print('two'); print('three')"
    code = supervise.supervise([sys.executable, "-c", printer], dict(os.environ), watch=slow_watch)
    assert code == 1 and watched == ["one", "two", "three"]  # exit 0 unasked: status 1
    monkeypatch.setattr(supervise, "RELAY_DRAIN_S", 0.5)
    leaves_a_worker = (
        "import subprocess, sys; "
        "w = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        "print('worker', w.pid, flush=True)"
    )
    watched.clear()
    started = time.monotonic()
    try:
        supervise.supervise(
            [sys.executable, "-c", leaves_a_worker], dict(os.environ), watch=watched.append
        )
        assert time.monotonic() - started < 5  # the 0.5 s bound, not the worker's 60 s
    finally:
        for line in watched:
            os.kill(int(line.split()[1]), signal.SIGKILL)
    assert len(watched) == 1 and watched[0].startswith("worker ")


# --- the probe at start (KV_TRANSPORT_CHECK) ---------------------------------------------------
CU12_FIRST = (DATA / "nixl_h200_cu12_libucs_first.err").read_text()


def probe_json_line(run: ProbeRun) -> str:
    """The probe's real stdout: one JSON line (transfer times, GB/s, the data checked)."""
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout


def test_check_mode_defaults_to_warn_and_refuses_typos() -> None:
    assert transport_check.check_mode(None) == "warn"
    assert transport_check.check_mode(" Refuse ") == "refuse"
    with pytest.raises(ValueError, match="KV_TRANSPORT_CHECK"):
        transport_check.check_mode("loud")


def test_verdict_on_the_h200_tables_with_the_probes_real_output(cpu_probe: ProbeRun) -> None:
    """The H200's two UCX tables judged with the JSON line the probe really prints (this
    machine's run: its GB/s, not the H200's, which docs/gpu.md records from that session)."""
    stdout = probe_json_line(cpu_probe)
    rate = f"{json.loads(stdout.strip().splitlines()[-1])['gb_per_s']:.1f} GB/s"
    good = transport_check.probe_verdict(0, stdout, "", H200_ZCOPY_Y)
    assert good.problem is None and not good.unknown
    assert "cuda_ipc/cuda" in good.summary and good.summary.endswith(rate), good.summary
    slow = transport_check.probe_verdict(0, stdout, "", H200_ZCOPY_AUTO)
    assert slow.problem == "the KV pull runs over TCP only (software emulation)"
    assert slow.summary.endswith(f"tcp/lo, {rate}"), slow.summary
    # nixl#1628 as the H200 showed it: registration fails, no table, the probe exits 1.
    host = transport_check.probe_verdict(
        1, "", CU12_FIRST + "RuntimeError: the target agent ...\n", ""
    )
    assert host.problem is not None and "host memory" in host.problem


def test_a_probe_that_could_not_run_is_unknown_not_a_verdict(cpu_probe: ProbeRun) -> None:
    crashed = transport_check.probe_verdict(1, "", "Traceback ...\nImportError: no nixl\n", "")
    assert crashed.unknown and crashed.problem is None and "ImportError: no nixl" in crashed.summary
    # UCX_PROTO_INFO off: the probe's real line, but no table to read.
    silent = transport_check.probe_verdict(0, probe_json_line(cpu_probe), "", "")
    assert silent.unknown and silent.problem is None


def test_check_kv_transport_warns_refuses_or_stays_quiet(capsys) -> None:
    tcp = transport_check.ProbeVerdict(
        "a tcp/lo table", "the KV pull runs over TCP only (software emulation)"
    )
    calls: list[str] = []

    def probe(env):
        calls.append(env["CUDA_VISIBLE_DEVICES"])
        return tcp

    env = {"CUDA_VISIBLE_DEVICES": "3"}
    assert transport_check.check_kv_transport(env, "warn", probe) is None
    err = capsys.readouterr().err
    assert "KV TRANSPORT WARNING: at start" in err and "[a tcp/lo table]" in err
    refusal = transport_check.check_kv_transport(env, "refuse", probe)
    assert (
        refusal == "KV_TRANSPORT_CHECK=refuse: the KV pull runs over TCP only (software emulation)"
    )
    assert transport_check.check_kv_transport(env, "off", probe) is None and calls == ["3", "3"]
    fine = transport_check.check_kv_transport(
        env, "refuse", lambda e: transport_check.ProbeVerdict("cuda_ipc/cuda")
    )
    assert fine is None and "KV pull transport at start: cuda_ipc/cuda" in capsys.readouterr().err
    unknown = transport_check.ProbeVerdict("the probe failed (exit 1): ImportError", unknown=True)
    assert (
        transport_check.check_kv_transport(env, "refuse", lambda e: unknown) is None
    )  # never on a guess
    assert "KV transport not checked at start" in capsys.readouterr().err


def test_the_real_probe_on_this_cpu_machine_is_unknown_not_a_refusal() -> None:
    """The entrypoint's probe_kv_transport as it runs: `--device cuda` on a machine with no GPU
    fails in the probe, which must read as "not checked", never as TCP."""
    start = time.monotonic()
    verdict = transport_check.probe_kv_transport({**os.environ, "UCX_TLS": "tcp,self"})
    assert verdict.unknown and verdict.problem is None, verdict
    # A side that dies is noticed at once, not after the probe's 60 s wait for its answer.
    assert time.monotonic() - start < 45, verdict
