"""Closed by default (compose/entrypoint/bind_policy.py through keygen) and the namespace holder's
drain (compose/entrypoint/holder.py): the pure rules, then keygen and the drain as processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import bind_policy as policy
import holder
import pytest

from tests.entrypoint import ENTRYPOINT_DIR

KEYGEN = ENTRYPOINT_DIR / "keygen.py"


@pytest.mark.parametrize(
    ("address", "keys", "opt_out", "refused"),
    [
        ("127.0.0.1", "", "0", False),  # the default
        ("", "", "", False),  # unset: loopback
        ("::1", "", "0", False),
        ("localhost", "", "0", False),
        ("0.0.0.0", "", "0", True),
        ("0.0.0.0", "# a comment only\n\n", "0", True),
        ("192.168.1.5", "", "", True),
        ("0.0.0.0", "sk-1\n", "0", False),
        ("0.0.0.0", "", "1", False),  # open on purpose
        ("0.0.0.0", "", "TRUE", False),
    ],
)
def test_binding_beyond_loopback_needs_keys_or_the_opt_out(address, keys, opt_out, refused) -> None:
    env = {"KIT_PROXY_BIND_ADDRESS": address, "KIT_PROXY_OPEN_WITHOUT_KEYS": opt_out}
    why = policy.refusal(env, keys)
    assert (why is not None) == refused, why
    if refused:
        assert f"PROXY_BIND_ADDRESS={address}" in why and "PROXY_OPEN_WITHOUT_KEYS=1" in why


def test_a_bad_opt_out_is_refused() -> None:
    env = {"KIT_PROXY_BIND_ADDRESS": "0.0.0.0", "KIT_PROXY_OPEN_WITHOUT_KEYS": "yes please"}
    with pytest.raises(ValueError, match="PROXY_OPEN_WITHOUT_KEYS"):
        policy.refusal(env, "")


def run_keygen(
    tmp_path: Path, env: dict[str, str], keys: str | None
) -> subprocess.CompletedProcess:
    """keygen.py's check as compose runs it (a process), its folders moved under tmp_path."""
    secrets_dir = tmp_path / "secrets"
    secrets_dir.mkdir(exist_ok=True)
    if keys is not None:
        (secrets_dir / "api_keys").write_text(keys)
    script = (
        f"import sys; sys.path.insert(0, {str(KEYGEN.parent)!r}); import keygen\n"
        f"from pathlib import Path; keygen.SECRETS = Path({str(secrets_dir)!r})\n"
        "keygen.check_binding()\n"
    )
    return subprocess.run(
        [sys.executable, "-c", script],
        env={"PATH": "/usr/bin:/bin", **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_keygen_stops_up_for_an_open_proxy_without_keys(tmp_path) -> None:
    env = {"KIT_PROXY_BIND_ADDRESS": "0.0.0.0", "KIT_PROXY_OPEN_WITHOUT_KEYS": "0"}
    res = run_keygen(tmp_path, env, None)
    assert res.returncode == 2
    assert res.stderr.startswith("keygen: refusing to start the proxy: PROXY_BIND_ADDRESS=0.0.0.0")
    assert run_keygen(tmp_path, env, "sk-abc\n").returncode == 0
    assert run_keygen(tmp_path, {"KIT_PROXY_BIND_ADDRESS": "127.0.0.1"}, None).returncode == 0


# ------------------------------------------------------------------ the holder's drain
def test_joined_processes_are_those_whose_parent_is_outside(tmp_path) -> None:
    """A fake /proc: PID 1 (init), the holder itself (PPid 1), two servers' entrypoints (PPid 0:
    their parent is outside the namespace) and vLLM under one of them."""
    for pid, ppid in ((1, 0), (7, 1), (20, 0), (21, 20), (40, 0)):
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "status").write_text(f"Name:\tx\nPid:\t{pid}\nPPid:\t{ppid}\n")
    (tmp_path / "self").mkdir()
    assert holder.joined_processes(tmp_path, own=[7]) == [20, 40]


def test_drain_signals_the_servers_and_waits_for_them(tmp_path) -> None:
    """Real processes that take a second to drain after SIGTERM: the holder returns only once
    they are gone."""
    drain_script = (
        "import signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *a: (time.sleep(1.0), sys.exit(0)))\n"
        "print('up', flush=True)\n"
        "time.sleep(600)\n"
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", drain_script], stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    try:
        for proc in procs:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "up"
        logged: list[str] = []

        def alive() -> list[int]:
            return [p.pid for p in procs if p.poll() is None]

        start = time.monotonic()
        left = holder.drain(alive, os.kill, 30, logged.append)
        took = time.monotonic() - start
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    assert left == [] and took >= 0.9
    assert [p.returncode for p in procs] == [0, 0]  # drained, not killed
    assert logged[-1] == "holder: every server exited: done"


def test_drain_gives_up_after_its_limit() -> None:
    now = [0.0]
    killed: list[tuple[int, int]] = []

    def sleep(seconds: float) -> None:
        now[0] += seconds

    left = holder.drain(
        lambda: [5],
        lambda pid, sig: killed.append((pid, sig)),
        3,
        lambda m: None,
        clock=lambda: now[0],
        sleep=sleep,
    )
    assert left == [5] and killed == [(5, signal.SIGTERM)] and now[0] >= 3
