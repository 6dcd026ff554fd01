"""ManagedProcess and wait_healthy against small stand-in processes (no vLLM)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import pcp_pd_kit.localstack
from pcp_pd_kit.localstack.commands import ProcessSpec
from pcp_pd_kit.localstack.host import PortInUseError, ensure_ports_free, port_is_free
from pcp_pd_kit.localstack.process import ManagedProcess, StackProcessError, wait_healthy
from pcp_pd_kit.localstack.stack import Stack
from tests.support.env import example_settings
from tests.support.net import busy_port, free_port


def test_process_that_dies_is_named_with_its_log_tail(tmp_path: Path) -> None:
    code = "import sys; print('boom: missing weights'); sys.exit(3)"
    proc = ManagedProcess(
        ProcessSpec("decode", [sys.executable, "-c", code], health_url="http://127.0.0.1:1/h"),
        tmp_path,
    )
    proc.start()
    try:
        with pytest.raises(StackProcessError, match=r"(?s)decode exited with code 3.*boom"):
            wait_healthy([proc], timeout_s=30)
    finally:
        proc.stop()


def test_never_healthy_times_out_naming_the_process(tmp_path: Path) -> None:
    proc = ManagedProcess(
        ProcessSpec(
            "prefill",
            [sys.executable, "-c", "import time; time.sleep(60)"],
            health_url=f"http://127.0.0.1:{free_port()}/health",
        ),
        tmp_path,
    )
    proc.start()
    try:
        with pytest.raises(StackProcessError, match="not healthy after 1s: prefill"):
            wait_healthy([proc], timeout_s=1)
    finally:
        proc.stop()
    assert not proc.is_running()


def test_healthy_http_server_is_detected(tmp_path: Path) -> None:
    port = free_port()
    proc = ManagedProcess(
        ProcessSpec(
            "proxy",
            [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
            health_url=f"http://127.0.0.1:{port}/",
        ),
        tmp_path,
    )
    proc.start()
    try:
        wait_healthy([proc], timeout_s=30)
        assert proc.healthy_after_s is not None
    finally:
        proc.stop()


def test_stop_ends_the_whole_process_group(tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    script = (
        "import subprocess, sys, time; "
        "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
        f"open({str(pid_file)!r}, 'w').write(str(c.pid)); time.sleep(120)"
    )
    proc = ManagedProcess(ProcessSpec("engine", [sys.executable, "-c", script]), tmp_path)
    proc.start()
    deadline = time.monotonic() + 20
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline, "child never started"
        time.sleep(0.1)
    child = int(pid_file.read_text())
    proc.stop(grace_s=5)
    # stop() waits for the leader only: the child's own exit (or reaping) needs its turn on a
    # CPU, which a loaded host may not give it within a fixed 0.2 s. Without the group signal it
    # would live for 120 s.
    deadline = time.monotonic() + 30
    while _alive(child):
        assert time.monotonic() < deadline, "the child outlived its process group's stop"
        time.sleep(0.05)


def test_port_in_use_is_reported_before_anything_starts(tmp_path: Path) -> None:
    with busy_port() as busy:
        assert not port_is_free("127.0.0.1", busy)
        with pytest.raises(PortInUseError, match=f"decode port {busy}"):
            ensure_ports_free("127.0.0.1", {"decode": busy})
        stack = Stack(example_settings(proxy_port=busy), work_dir=tmp_path)
        with pytest.raises(PortInUseError, match=f"proxy port {busy}"):
            stack.start()
        assert stack.processes == {}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(PR_SET_PDEATHSIG) is Linux")
def test_child_gets_sigterm_when_the_launcher_is_killed(tmp_path: Path) -> None:
    """A SIGKILLed launcher runs no cleanup; the kernel's parent-death signal ends the child."""
    launcher = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from pcp_pd_kit.localstack.commands import ProcessSpec\n"
        "from pcp_pd_kit.localstack.process import ManagedProcess\n"
        "p = ManagedProcess(ProcessSpec('orphan', [sys.executable, '-c', "
        "'import time; time.sleep(120)']), Path(sys.argv[1]))\n"
        "p.start()\n"
        "print(p.popen.pid, flush=True)\n"
        "time.sleep(120)\n"
    )
    scripts = str(
        Path(pcp_pd_kit.localstack.__file__).resolve().parents[1]
    )  # the package under test
    parent = subprocess.Popen(
        [sys.executable, "-c", launcher, str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": scripts},
    )
    child = 0
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        assert _alive(child)
        parent.kill()
        parent.wait(timeout=10)
        deadline = time.monotonic() + 15
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(child), "child outlived its SIGKILLed launcher"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        if child and _alive(child):
            os.kill(child, signal.SIGKILL)


def _alive(pid: int) -> bool:
    """Running, i.e. neither gone nor a zombie waiting for its new parent to reap it."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_stack_stops_the_proxy_first(tmp_path: Path) -> None:
    stopped: list[str] = []

    class _Fake:
        def __init__(self, name: str) -> None:
            self.name = name

        def stop(self) -> None:
            stopped.append(self.name)

    stack = Stack(example_settings(), work_dir=tmp_path)
    parts = ("prefill", "decode", "prometheus", "proxy")
    stack.processes = {p: _Fake(p) for p in parts}  # type: ignore[misc]
    stack.stop()
    assert stopped[0] == "proxy" and stopped[-1] == "prefill"
