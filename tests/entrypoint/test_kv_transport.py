"""The KV transport on a GPU host (compose/entrypoint/kv_transport.py): the nixl CUDA build's UCX
modules picked to match torch, and UCX's protocol tables read as vLLM runs. Every table is UCX's
real output (nixl 1.5.1's UCX) for a NIXL READ between two agents by scripts/nixl_read_probe.py:
over tcp/lo on a CPU machine, and between two processes on one H200 (torch 2.11+cu130, nixl_cu13)
with cuda_ipc GET zero-copy forced (`y`, what compose sets) and left at UCX's `auto`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.entrypoint.loader import entrypoint

serve = entrypoint()
kv = serve._sibling("kv_transport")
DATA = Path(__file__).with_name("data")
CPU_CAPTURE = (DATA / "ucx_proto_info_cpu_tcp.txt").read_text()
PULL_HOST = "remote memory read by ucp_get*(multi) into host memory from host"
H200_ZCOPY_Y = (DATA / "ucx_proto_info_h200_get_zcopy_y.txt").read_text()
H200_ZCOPY_AUTO = (DATA / "ucx_proto_info_h200_get_zcopy_auto.txt").read_text()
PULL_GPU = "remote memory read by ucp_get*(multi) into cuda/GPU0 from cuda/dev[1]"


PRINT_FILE = "import sys; sys.stdout.write(open(sys.argv[1]).read())"


def tables(text: str) -> list:
    scanner = kv.ProtoScanner()
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
    scanner = kv.ProtoScanner()
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
    assert kv.torch_cuda_major(tmp_path) == want


def test_nixls_builds_in_this_venv_each_carry_the_cuda_module() -> None:
    """The installed nixl 1.5.1: both CUDA builds, each with its own UCX modules folder."""
    site, _ = serve.install_paths()
    for major in (12, 13):
        folder = kv.nixl_ucx_dir(site, major)
        assert folder == site / f"nixl_cu{major}.libs" / "ucx"


def test_a_build_without_the_cuda_module_is_refused(tmp_path) -> None:
    (tmp_path / "nixl_cu12.libs" / "ucx").mkdir(parents=True)
    (tmp_path / "nixl_cu12.libs" / "ucx" / "libuct_ib.so.0").write_text("")
    with pytest.raises(ValueError, match="has no libuct_cuda.so"):
        kv.nixl_ucx_dir(tmp_path, 12)
    with pytest.raises(ValueError, match="no .*nixl_cu13.libs/ucx for torch's CUDA 13"):
        kv.nixl_ucx_dir(tmp_path, 13)


def test_gpu_env_pins_the_matching_build_and_warns_about_auto(tmp_path) -> None:
    site, _ = serve.install_paths()
    torch_dir = tmp_path / "torch"
    torch_dir.mkdir()
    (torch_dir / "version.py").write_text("cuda: Optional[str] = '13.0'\n")
    env = {"UCX_TLS": "cuda_ipc,cuda_copy,tcp,sm,self", "UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y"}
    extra, warnings = kv.gpu_ucx_env(env, site, torch_dir)
    assert extra == {"UCX_MODULE_DIR": str(site / "nixl_cu13.libs" / "ucx")} and warnings == []
    _, warnings = kv.gpu_ucx_env({"UCX_TLS": "tcp,self"}, site, torch_dir)
    assert len(warnings) == 2 and "(unset: auto)" in warnings[0] and "no cuda_ipc" in warnings[1]
    cpu_torch = Path(serve.install_paths()[1])  # this machine's torch is a CPU build
    with pytest.raises(ValueError, match="CPU build"):
        kv.gpu_ucx_env(env, site, cpu_torch)


def test_supervise_relays_vllms_stdout_and_the_watch_sees_ucx_tables(tmp_path) -> None:
    """A stand-in vLLM (a real process) prints UCX's table: our stdout gets it unchanged, the
    entrypoint's watcher flags the TCP pull."""
    capture = tmp_path / "ucx.txt"
    capture.write_text(H200_ZCOPY_AUTO)
    runner = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('s', {str(Path(serve.__file__))!r})\n"
        "s = importlib.util.module_from_spec(spec); spec.loader.exec_module(s)\n"
        "seen = []\n"
        "kv = s._sibling('kv_transport')\n"
        "scanner = kv.ProtoScanner()\n"
        "def watch(line):\n"
        "    for t in scanner.feed(line):\n"
        "        if t.is_remote_read(): seen.append(t.problem_on_gpu())\n"
        f"cmd = [sys.executable, '-c', {PRINT_FILE!r}, {str(capture)!r}]\n"
        "code = s.supervise(cmd, {}, interfaces=frozenset, poll_s=0.1, watch=watch)\n"
        "import time; time.sleep(0.3)\n"
        "print('SEEN', seen, file=sys.stderr)\n"
    )
    res = subprocess.run([sys.executable, "-c", runner], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout == H200_ZCOPY_AUTO  # relayed byte for byte
    assert "SEEN ['the KV pull runs over TCP only (software emulation)']" in res.stderr
