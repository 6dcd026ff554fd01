"""Slots by lease (compose/entrypoint/vllm_serve/slots.py and the entrypoint's use of it): real
flock locks on real files, held and released by real processes, so the kernel's semantics are what
is tested. The GPU ids a replica gets follow the slot it leased, never compose's container
number."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from vllm_serve import main as entry
from vllm_serve import slots

from tests.entrypoint.loader import PACKAGE, main_env

PREFILL_ARGV = ["--model", "m", "--tensor-parallel-size", "1", "--prefill-context-parallel-size=2"]
CONNECTOR = {
    "KIT_KV_CONNECTOR": "PcpCanonicalNixlConnector",
    "KIT_KV_CONNECTOR_MODULE_PATH": "pcp_nixl_connector",
}
# A process that holds a slot's lock until it is killed (it prints once it holds it).
HOLD = (
    "import fcntl, os, sys, time\n"
    "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)\n"
    "fcntl.flock(fd, fcntl.LOCK_EX)\n"
    "os.write(fd, b'other-container (pid %d)' % os.getpid())\n"
    "print('held', flush=True)\n"
    "time.sleep(600)\n"
)


@pytest.fixture
def holders():
    """Start processes that hold slot files; every one is killed at the end."""
    procs: list[subprocess.Popen[str]] = []

    def hold(path: Path) -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            [sys.executable, "-c", HOLD, str(path)], stdout=subprocess.PIPE, text=True
        )
        procs.append(proc)
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
        return proc

    yield hold
    for proc in procs:
        proc.kill()
        proc.wait()


def never_stop(_seconds: float) -> bool:
    return False


def test_the_container_number_is_tried_first(tmp_path) -> None:
    order = slots.slot_order(3, 2)
    assert order == [2, 1, 3]
    lease = slots.lease_slot(
        tmp_path, "kv_producer", order, 3, "PREFILL_REPLICAS", never_stop, print
    )
    assert (lease.slot, lease.path.name) == (2, "prefill-slot-2")


def test_a_number_past_the_count_takes_a_free_slot(tmp_path, holders) -> None:
    """`docker rm` of replica 2, then `up`: compose names the new container 3 of 2."""
    holders(tmp_path / "prefill-slot-1")
    order = slots.slot_order(2, 3)
    lease = slots.lease_slot(
        tmp_path, "kv_producer", order, 2, "PREFILL_REPLICAS", never_stop, print
    )
    assert lease.slot == 2


def test_a_slot_held_in_this_process_is_not_leased_twice(tmp_path) -> None:
    first = slots.lease_slot(
        tmp_path, "kv_consumer", [1, 2], 2, "DECODE_REPLICAS", never_stop, print
    )
    second = slots.lease_slot(
        tmp_path, "kv_consumer", [1, 2], 2, "DECODE_REPLICAS", never_stop, print
    )
    assert (first.slot, second.slot) == (1, 2)


def test_every_slot_held_waits_saying_why_and_a_stop_ends_the_wait(tmp_path, holders) -> None:
    holders(tmp_path / "prefill-slot-1")
    logged: list[str] = []
    waits: list[float] = []

    def wait(seconds: float) -> bool:
        waits.append(seconds)
        return len(waits) == 3  # asked to stop on the third poll

    lease = slots.lease_slot(
        tmp_path, "kv_producer", [1], 1, "PREFILL_REPLICAS", wait, logged.append, log_every_s=4
    )
    assert lease is None and len(waits) == 3
    assert len(logged) == 2  # at once, then after log_every_s of polls
    assert "every prefill slot is held (slot 1 by other-container (pid " in logged[0]
    assert "PREFILL_REPLICAS=1, so this container is one too many" in logged[0]


def test_a_killed_holder_frees_its_slot(tmp_path, holders) -> None:
    """SIGKILL, no clean-up: the kernel drops the lock with the process."""
    proc = holders(tmp_path / "decode-slot-1")
    assert slots.try_lease(tmp_path, "kv_consumer", [1], "me") is None
    proc.kill()
    proc.wait()
    lease = slots.try_lease(tmp_path, "kv_consumer", [1], "me")
    assert lease is not None and lease.slot == 1
    assert (tmp_path / "decode-slot-1").read_text() == "me"


def start_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {**CONNECTOR, "KIT_KV_ROLE": "kv_producer", "KIT_ALL_GPUS": "all"}
    env |= {"VLLM_NIXL_SIDE_CHANNEL_HOST": "172.28.0.9", "KIT_SLOT_DIR": str(tmp_path / "slots")}
    env |= {"KIT_CRASH_FILE": str(tmp_path / "crashes.json")}
    return env | extra


def run_main(monkeypatch, tmp_path, env, lookup=None) -> list[dict[str, str]]:
    main_env(monkeypatch, tmp_path, env)
    if lookup is not None:
        monkeypatch.setattr(entry, "looked_up_index", lookup)
    seen: list[dict[str, str]] = []
    monkeypatch.setattr(entry, "supervise", lambda cmd, env, **kw: seen.append(env) or 0)
    monkeypatch.setattr(entry, "wait_for_gpus", lambda env, argv, stop: None)
    monkeypatch.setattr(entry, "kv_transport_setup", lambda env: ({}, None))
    monkeypatch.setattr(entry, "check_kv_transport", lambda env, mode: None)  # its own tests
    with pytest.raises(SystemExit) as done:
        entry.main(PREFILL_ARGV)
    assert done.value.code == 0
    return seen


def test_rm_then_up_gets_the_free_slots_gpus(monkeypatch, tmp_path, holders, capsys) -> None:
    """Replica 1 runs on slot 1; the new container is number 3 of 2 (compose's max+1). Today's
    code refused it (index 3 outside 1..2, exit 2); now it takes slot 2 and GPUs 2,3."""
    (tmp_path / "slots").mkdir()
    holders(tmp_path / "slots" / "prefill-slot-1")
    env = start_env(tmp_path, KIT_ROLE_GPUS="0,1,2,3", KIT_ROLE_REPLICAS="2")
    seen = run_main(monkeypatch, tmp_path, env, lookup=lambda: 3)
    assert seen[0]["CUDA_VISIBLE_DEVICES"] == "2,3"
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("vllm_serve: replica 2 of 2 (lease prefill-slot-2), GPUs 2,3,")


def test_force_recreate_keeps_slots_disjoint(monkeypatch, tmp_path, holders) -> None:
    """Two containers both numbered 1 (a recreate racing the old one): the second gets slot 2."""
    (tmp_path / "slots").mkdir()
    holders(tmp_path / "slots" / "prefill-slot-1")
    env = start_env(tmp_path, KIT_ROLE_GPUS="0,1,2,3", KIT_ROLE_REPLICAS="2")
    seen = run_main(monkeypatch, tmp_path, env, lookup=lambda: 1)
    assert seen[0]["CUDA_VISIBLE_DEVICES"] == "2,3"


def test_cpu_profile_failed_lookup_is_a_real_slot_not_zero(monkeypatch, tmp_path, capsys) -> None:
    def broken() -> int:
        raise ValueError("reverse DNS failed")

    env = start_env(tmp_path, KIT_ROLE_REPLICAS="2")
    run_main(monkeypatch, tmp_path, env, lookup=broken)
    out = capsys.readouterr()
    assert out.out.splitlines()[0].startswith("vllm_serve: replica 1 of 2 (lease prefill-slot-1),")
    assert "container number unknown (reverse DNS failed): taking the first free slot" in out.err


def test_replica_index_pins_its_slot(monkeypatch, tmp_path, capsys) -> None:
    env = start_env(tmp_path, KIT_ROLE_GPUS="0,1,2,3", KIT_ROLE_REPLICAS="2")
    seen = run_main(monkeypatch, tmp_path, env | {"KIT_REPLICA_INDEX": "2"}, lookup=lambda: 1)
    assert seen[0]["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert "(lease prefill-slot-2)" in capsys.readouterr().out


def test_one_replica_too_many_waits_and_a_sigterm_exits_cleanly(tmp_path, holders) -> None:
    """`--scale prefill=2` with PREFILL_REPLICAS=1: the second container (the real entrypoint,
    a real process) waits, says so, leaves GPUs alone, and `docker stop` ends it with 0."""
    (tmp_path / "slots").mkdir()
    holders(tmp_path / "slots" / "prefill-slot-1")
    env = start_env(tmp_path, KIT_ROLE_GPUS="0,1", KIT_ROLE_REPLICAS="1")
    proc = subprocess.Popen(
        [sys.executable, str(PACKAGE), *PREFILL_ARGV],
        env={"PATH": "/usr/bin:/bin", **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()
        assert "every prefill slot is held (slot 1 by other-container" in line, line
        time.sleep(0.5)
        assert proc.poll() is None  # still waiting: no crash, no hold
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert "stopped while waiting for a slot" in err
    assert "CUDA_VISIBLE_DEVICES" not in out  # vLLM was never started
    assert (
        not os.path.exists(tmp_path / "crashes.json")
        or '"count": 0' in (tmp_path / "crashes.json").read_text()
    )


def test_a_bad_setting_is_refused_before_any_wait(tmp_path, holders) -> None:
    """A GPU list of the wrong length fails at once (exit 2), even while every slot is held."""
    (tmp_path / "slots").mkdir()
    holders(tmp_path / "slots" / "prefill-slot-1")
    env = start_env(tmp_path, KIT_ROLE_GPUS="0,1,2", KIT_ROLE_REPLICAS="1")
    res = subprocess.run(
        [sys.executable, str(PACKAGE), *PREFILL_ARGV],
        env={"PATH": "/usr/bin:/bin", **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2 and "PREFILL_GPUS lists 3 GPU(s)" in res.stderr
