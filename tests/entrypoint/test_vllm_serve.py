"""The vLLM containers' entrypoint: each role's GPUs inside a container that sees both roles',
and the one --kv-transfer-config the containers run with, built from their environment."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from vllm_serve import (
    command,
    crash_loop,
    environment,
    gpus,
    kv_config,
    replica,
    secret_files,
    supervise,
    switches,
)
from vllm_serve import main as entry

from tests.entrypoint import ENTRYPOINT_DIR
from tests.entrypoint.loader import CONTAINER_PATH, PACKAGE, effective_argv, main_env

CONNECTOR = {"KIT_KV_CONNECTOR": "PcpCanonicalNixlConnector"}
CONNECTOR |= {"KIT_KV_CONNECTOR_MODULE_PATH": "pcp_nixl_connector"}
PREFILL = {**CONNECTOR, "KIT_KV_ROLE": "kv_producer"}
DECODE_CPU = {**CONNECTOR, "KIT_KV_ROLE": "kv_consumer", "KIT_KV_BUFFER_DEVICE": "cpu"}
DECODE_CPU |= {"KIT_NIXL_PROGRESS_DELAY_US": "1000"}


@pytest.mark.parametrize(
    ("role", "all_ids", "want"),
    [
        (["0", "1"], ["0", "1", "2"], "0,1"),  # the defaults: prefill
        (["2"], ["0", "1", "2"], "2"),  # the defaults: decode
        (["4", "5"], ["4", "5", "6"], "0,1"),  # host ids are not container ids
        (["6"], ["4", "5", "6"], "2"),
        (["3"], ["5", "3", "4"], "0"),  # order of the list does not matter, PCI-bus order does
        (["10", "2"], ["2", "10", "11"], "1,0"),  # numeric, not string, order
        (["GPU-a", "GPU-b"], ["GPU-a", "GPU-b", "GPU-c"], "GPU-a,GPU-b"),
        # compose's `count: all`: the container sees every host GPU, host ids are its ids
        (["4", "5"], ["all"], "4,5"),
        (["2"], ["all"], "2"),
        (["GPU-b", "3"], ["all"], "GPU-b,3"),
    ],
)
def test_role_gpus_map_to_in_container_ids(role, all_ids, want) -> None:
    assert gpus.cuda_visible_devices(role, all_ids) == want


@pytest.mark.parametrize(
    ("role", "all_ids", "needle"),
    [(["7"], ["0", "1"], "not among"), (["0"], ["0", "GPU-x"], "mix of GPU indices")],
)
def test_bad_gpu_lists_are_refused(role, all_ids, needle) -> None:
    with pytest.raises(ValueError, match=needle):
        gpus.cuda_visible_devices(role, all_ids)


def test_environment_sets_devices_and_secrets_from_files(tmp_path, monkeypatch) -> None:
    token, key = tmp_path / "hf_token", tmp_path / "key"
    token.write_text("hf_secret\n")
    key.write_text("vllm-key")
    monkeypatch.setattr(secret_files, "HF_TOKEN_FILE", token)
    monkeypatch.setattr(secret_files, "VLLM_KEY_FILE", key)
    env = environment.serve_environment({"KIT_ROLE_GPUS": "2", "KIT_ALL_GPUS": "0,1,2", "X": "y"})
    assert env["CUDA_VISIBLE_DEVICES"] == "2"
    assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert (env["HF_TOKEN"], env["VLLM_API_KEY"], env["X"]) == ("hf_secret", "vllm-key", "y")
    every = environment.serve_environment(
        {"KIT_ROLE_GPUS": "5,6", "KIT_ALL_GPUS": "all"}, argv=["--tensor-parallel-size", "2"]
    )
    assert (every["CUDA_VISIBLE_DEVICES"], every["CUDA_DEVICE_ORDER"]) == ("5,6", "PCI_BUS_ID")
    # The list must hold the server's TP x PCP x PP ids: a TP1 server refuses two.
    with pytest.raises(ValueError, match="KIT_ROLE_GPUS lists 2 GPU"):
        environment.serve_environment({"KIT_ROLE_GPUS": "5,6", "KIT_ALL_GPUS": "all"})


def test_cpu_containers_and_absent_secrets_change_nothing(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(secret_files, "HF_TOKEN_FILE", tmp_path / "absent")
    empty = tmp_path / "empty"
    empty.write_text("")
    monkeypatch.setattr(secret_files, "VLLM_KEY_FILE", empty)
    host = {"VLLM_NIXL_SIDE_CHANNEL_HOST": "10.0.0.7"}
    assert environment.serve_environment({"A": "b", **host}) == {"A": "b", **host}


def test_side_channel_host_is_this_replicas_own_address() -> None:
    """Unset: the container's own address (a service name would resolve to every replica);
    set (Kubernetes' pod IP, the local stack): kept, and the address is not looked up."""

    def never() -> str:
        raise AssertionError("looked up although the variable was set")

    assert environment.serve_environment({"A": "b"}, address=lambda: "172.28.0.9") == {
        "A": "b",
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "172.28.0.9",
    }
    kept = environment.serve_environment({"VLLM_NIXL_SIDE_CHANNEL_HOST": "10.1.2.3"}, address=never)
    assert kept["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "10.1.2.3"


def test_own_address_resolves_this_hosts_name() -> None:
    """The real lookup, as in a container (Docker writes the hostname into /etc/hosts)."""
    import ipaddress
    import socket

    address = replica.own_address()
    assert ipaddress.ip_address(address)
    assert address == socket.gethostbyname(socket.gethostname())


# ------------------------------------------------------------------ --kv-transfer-config
def test_gpu_config_is_connector_module_and_role() -> None:
    assert kv_config.kv_transfer_config({**PREFILL, "UNRELATED": "x"}) == {
        "kv_connector": "PcpCanonicalNixlConnector",
        "kv_connector_module_path": "pcp_nixl_connector",
        "kv_role": "kv_producer",
    }
    decode = kv_config.kv_transfer_config({**PREFILL, "KIT_KV_ROLE": "kv_consumer"})
    assert decode["kv_role"] == "kv_consumer"
    # The delay is the CPU buffers' knob: without them it changes nothing.
    assert kv_config.kv_transfer_config({**PREFILL, "KIT_NIXL_PROGRESS_DELAY_US": "5"}) == (
        kv_config.kv_transfer_config(PREFILL)
    )


def test_cpu_buffers_add_the_connectors_cpu_options() -> None:
    assert kv_config.kv_transfer_config({**DECODE_CPU, "KIT_NIXL_PROGRESS_DELAY_US": "250"}) == {
        "kv_connector": "PcpCanonicalNixlConnector",
        "kv_connector_module_path": "pcp_nixl_connector",
        "kv_role": "kv_consumer",
        "kv_buffer_device": "cpu",
        "kv_connector_extra_config": {
            "cpu_nixl_progress_delay_us": 250,
            "cpu_skip_kv_core_pinning": True,
            "cpu_early_kv_load": False,
        },
    }
    assert kv_config.kv_transfer_config({**PREFILL, "KIT_KV_BUFFER_DEVICE": "cuda"}) == {
        **kv_config.kv_transfer_config(PREFILL),
        "kv_buffer_device": "cuda",
    }


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"KIT_KV_ROLE": "kv_both"}, "KIT_KV_ROLE='kv_both'"),
        ({"KIT_KV_ROLE": ""}, "KIT_KV_ROLE=''"),
        ({"KIT_KV_ROLE": None}, "KIT_KV_ROLE=''"),
        ({"KIT_KV_CONNECTOR": None}, "KIT_KV_CONNECTOR is not set"),
        ({"KIT_KV_CONNECTOR": "  "}, "KIT_KV_CONNECTOR is not set"),
        ({"KIT_KV_CONNECTOR_MODULE_PATH": ""}, "KIT_KV_CONNECTOR_MODULE_PATH is not set"),
        ({"KIT_KV_BUFFER_DEVICE": "gpu"}, "KIT_KV_BUFFER_DEVICE='gpu'"),
        ({"KIT_NIXL_PROGRESS_DELAY_US": "1000,"}, "KIT_NIXL_PROGRESS_DELAY_US='1000,'"),
        ({"KIT_NIXL_PROGRESS_DELAY_US": "-1"}, "non-negative integer"),
        ({"KIT_NIXL_PROGRESS_DELAY_US": "1e3"}, "non-negative integer"),
        ({"KIT_NIXL_PROGRESS_DELAY_US": None}, "KIT_NIXL_PROGRESS_DELAY_US=''"),
    ],
    ids=[
        "unknown-role",
        "empty-role",
        "no-role",
        "no-connector",
        "blank-connector",
        "no-module",
        "bad-device",
        "delay-comma",
        "delay-negative",
        "delay-float",
        "delay-missing",
    ],
)
def test_bad_or_missing_settings_are_refused(change, needle) -> None:
    env = {**DECODE_CPU, **{k: v for k, v in change.items() if v is not None}}
    for key in [k for k, v in change.items() if v is None]:
        env.pop(key)
    with pytest.raises(ValueError) as info:
        kv_config.kv_transfer_config(env)
    assert needle in str(info.value)
    assert "\n" not in str(info.value)


def test_extra_connectors_make_a_multiconnector_with_the_kits_first() -> None:
    extra = '[{"kv_connector":"ExampleConnector","kv_role":"kv_both"}]'
    alone = kv_config.kv_transfer_config(DECODE_CPU)
    config = kv_config.kv_transfer_config({**DECODE_CPU, "KIT_KV_EXTRA_CONNECTORS": extra})
    assert config["kv_connector"] == "MultiConnector" and config["kv_role"] == "kv_consumer"
    kit, example = config["kv_connector_extra_config"]["connectors"]
    assert kit == {
        **alone,
        "kv_connector_extra_config": {
            **alone["kv_connector_extra_config"],
            "pcp_completion_mode": "world_size",
        },
    }
    assert example == {"kv_connector": "ExampleConnector", "kv_role": "kv_both"}
    assert kv_config.kv_transfer_config({**DECODE_CPU, "KIT_KV_EXTRA_CONNECTORS": " "}) == alone


def test_bad_extra_connectors_are_refused_naming_both_variables() -> None:
    with pytest.raises(ValueError) as info:
        kv_config.kv_transfer_config({**DECODE_CPU, "KIT_KV_EXTRA_CONNECTORS": "[{oops"})
    assert "KIT_KV_EXTRA_CONNECTORS (KV_EXTRA_CONNECTORS) is not JSON" in str(info.value)
    assert "\n" not in str(info.value)


def test_command_appends_the_built_config() -> None:
    argv = ["--model", "m", "--port", "8100"]
    cmd = command.vllm_command(argv, PREFILL, "/usr/bin/python3")
    assert cmd[:3] == ["/usr/bin/python3", "-m", "vllm.entrypoints.launchers.api_server.entry"]
    assert cmd[3:-2] == argv
    assert cmd[-2] == "--kv-transfer-config"
    assert json.loads(cmd[-1]) == kv_config.kv_transfer_config(PREFILL)
    assert " " not in cmd[-1]  # one compact argv entry, as the compose files used to write it


def test_headless_engines_run_vllm_serve_with_the_same_config() -> None:
    """LeaderWorkerSet workers: no API server, the same connector and role as their leader."""
    cmd = command.vllm_command(["--model", "m", "--headless"], PREFILL, "python3")
    assert cmd[:2] == ["vllm", "serve"]
    assert cmd[-2:] == command.vllm_command(["--model", "m"], PREFILL, "python3")[-2:]


@pytest.mark.parametrize(
    "flag",
    [
        ["--kv-transfer-config", "{}"],
        ["--kv-transfer-config={}"],
        ["--kv_transfer_config", "{}"],
        ["--kv-transfer-config.kv_role", "kv_consumer"],
    ],
)
def test_a_config_in_the_arguments_is_refused(flag) -> None:
    with pytest.raises(ValueError, match="--kv-transfer-config is in the arguments"):
        command.vllm_command(["--model", "m", *flag], PREFILL, "python3")


def test_effective_argv_goes_through_the_entrypoint_only() -> None:
    container = ["python3", CONTAINER_PATH, "--port", "8200"]
    decode = {**PREFILL, "KIT_KV_ROLE": "kv_consumer"}
    assert effective_argv(container, decode) == command.vllm_command(
        ["--port", "8200"], decode, "python3"
    )
    assert effective_argv(["vllm", "serve", "--port", "1"], {}) == ["vllm", "serve", "--port", "1"]


def test_main_runs_vllm_with_the_config(monkeypatch, tmp_path, capsys) -> None:
    main_env(monkeypatch, tmp_path, DECODE_CPU)
    seen = []
    monkeypatch.setattr(entry, "supervise", lambda cmd, env, **kw: seen.append((cmd, env)) or 0)
    with pytest.raises(SystemExit) as done:
        entry.main(["--port", "8200"])
    assert done.value.code == 0
    ((cmd, env),) = seen
    assert cmd == command.vllm_command(["--port", "8200"], DECODE_CPU, sys.executable)
    assert env["KIT_KV_ROLE"] == "kv_consumer"
    assert f"--kv-transfer-config {cmd[-1]}" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("returncode", "stopped", "status"),
    [
        (0, True, 0),  # compose stop: vLLM drained and exited 0
        (0, False, 1),  # vLLM's API server after its engine died: a crash, restart it
        (3, False, 3),
        (-9, False, 137),  # killed: the shell's 128 + signal
    ],
)
def test_exit_status_makes_an_unasked_exit_a_failure(returncode, stopped, status) -> None:
    assert supervise.exit_status(returncode, stopped) == status


# For the runners below: SIGTERM to this process once supervise() forwards it (its handler is
# in place) and, given a path, once the child has its own (it creates the file). Not after a
# fixed second: a loaded host may not have started the child by then, and a SIGTERM that kills
# it before its handler exists is not the stop under test.
STOP_WHEN_SUPERVISING = (
    "def stop_when_supervising(ready=None):\n"
    "    deadline = time.monotonic() + 30\n"
    "    while time.monotonic() < deadline and (\n"
    "        signal.getsignal(signal.SIGTERM) is signal.SIG_DFL\n"
    "        or (ready is not None and not ready.exists())\n"
    "    ):\n"
    "        time.sleep(0.01)\n"
    "    os.kill(os.getpid(), signal.SIGTERM)\n"
)


def test_supervise_forwards_sigterm_and_reports_an_unasked_exit(tmp_path) -> None:
    """For real: a child that exits 0 by itself is a failure; one stopped by SIGTERM is not."""
    script = tmp_path / "child.py"
    script.write_text(
        "import pathlib, signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))\n"
        "pathlib.Path(sys.argv[2]).touch()  # its handler is in place\n"
        "time.sleep(float(sys.argv[1]))\n"
    )
    runner = (
        "import os, pathlib, signal, sys, threading, time\n"
        f"sys.path.insert(0, {str(ENTRYPOINT_DIR)!r})\n"
        "from vllm_serve.supervise import supervise\n"
        f"ready = pathlib.Path({str(tmp_path)!r}) / ('ready-' + sys.argv[1])\n"
        f"{STOP_WHEN_SUPERVISING}"
        "if sys.argv[1] == 'stop':\n"
        "    threading.Thread(target=stop_when_supervising, args=(ready,), daemon=True).start()\n"
        f"cmd = [sys.executable, {str(script)!r}, '30' if sys.argv[1] == 'stop' else '0', "
        "str(ready)]\n"
        "sys.exit(supervise(cmd, dict(os.environ)))\n"
    )
    stopped = subprocess.run(
        [sys.executable, "-c", runner, "stop"], capture_output=True, timeout=60
    )
    crashed = subprocess.run(
        [sys.executable, "-c", runner, "exit"], capture_output=True, text=True, timeout=60
    )
    assert stopped.returncode == 0, stopped.stderr
    assert crashed.returncode == 1 and "without being asked to stop" in crashed.stderr


@pytest.mark.parametrize(
    ("env", "argv", "needle"),
    [
        ({**PREFILL, "KIT_KV_ROLE": "prefill"}, [], "KIT_KV_ROLE='prefill'"),
        ({**DECODE_CPU, "KIT_NIXL_PROGRESS_DELAY_US": "1ms"}, [], "'1ms'"),
        ({**DECODE_CPU, "KIT_NIXL_EARLY_KV_LOAD": "yes"}, [], "KIT_NIXL_EARLY_KV_LOAD='yes'"),
        (CONNECTOR, [], "KIT_KV_ROLE=''"),
        (PREFILL, ["--kv-transfer-config", "{}"], "is in the arguments"),
        ({**PREFILL, "KIT_ENFORCE_EAGER": "yes"}, [], "KIT_ENFORCE_EAGER='yes' (ENFORCE_EAGER)"),
        ({**PREFILL, "KIT_ENFORCE_EAGER": "2"}, [], "want 1/true/on or 0/false/off/empty"),
    ],
    ids=["unknown-role", "bad-delay", "bad-early-load", "no-role", "flag-given", "eager", "eager2"],
)
def test_the_container_exits_with_one_clear_line(env, argv, needle, tmp_path) -> None:
    """Run as the container runs it: a refusal is one line on stderr and exit 2, before vLLM
    starts (nothing on stdout); the refusal counts towards the crash-loop bound."""
    crashes = tmp_path / "crashes.json"
    res = subprocess.run(
        [sys.executable, str(PACKAGE), "--model", "m", *argv],
        env={"PATH": "/usr/bin:/bin", "KIT_CRASH_FILE": str(crashes), **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2
    assert json.loads(crashes.read_text())["count"] == 1
    assert res.stdout == ""
    lines = res.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("vllm_serve: ") and needle in lines[0], lines


@pytest.mark.parametrize(
    ("before", "now", "want"),
    [
        ({(1, "eth0")}, {(1, "eth0")}, None),
        ({(1, "eth0")}, set(), "gone: eth0"),  # docker network disconnect
        ({(1, "eth0")}, {(7, "eth1")}, "gone: eth0; new: eth1"),  # ... and connect again
        (set(), {(7, "eth1")}, "new: eth1"),  # started while disconnected
        ({(1, "eth0"), (2, "eth1")}, {(2, "eth1")}, "gone: eth0"),
    ],
)
def test_interface_change_names_what_ucx_no_longer_has(before, now, want) -> None:
    assert supervise.interface_change(frozenset(before), frozenset(now)) == want


def test_network_interfaces_leave_out_loopback() -> None:
    names = {name for _, name in supervise.network_interfaces()}
    assert "lo" not in names


def test_supervise_stops_vllm_and_exits_1_when_an_interface_goes(tmp_path, monkeypatch) -> None:
    """For real: the child gets SIGTERM (vLLM drains) once the interfaces differ from the start,
    and the container's status is 1 for the restart policy, though the child exited 0."""
    monkeypatch.setattr(supervise.signal, "signal", lambda *args: None)  # keep pytest's handlers
    marker, ready = tmp_path / "terminated", tmp_path / "ready"
    script = tmp_path / "child.py"
    script.write_text(
        "import pathlib, signal, sys, time\n"
        f"signal.signal(signal.SIGTERM, lambda *a: (pathlib.Path({str(marker)!r}).touch(), "
        "sys.exit(0)))\n"
        f"pathlib.Path({str(ready)!r}).touch()\n"
        "time.sleep(60)\n"
    )
    views: list[int] = []

    def interfaces() -> frozenset[tuple[int, str]]:
        """The start's view and one poll's alike; a change once the child has its handler (a
        loaded host may take longer than a few polls to start it, and a SIGTERM before its
        handler exists would kill it, untouched)."""
        views.append(len(views))
        if len(views) <= 2 or not ready.exists():
            return frozenset({(1, "eth0")})
        return frozenset({(9, "eth1")})

    status = supervise.supervise(
        [sys.executable, str(script)], dict(os.environ), interfaces=interfaces, poll_s=0.2
    )
    assert status == 1 and marker.exists()


def test_early_kv_load_follows_its_knob_and_defaults_off() -> None:
    def early(env: dict[str, str]) -> object:
        extra = kv_config.kv_transfer_config(env)["kv_connector_extra_config"]
        return extra["cpu_early_kv_load"]  # type: ignore[index]

    assert early({**DECODE_CPU, "KIT_NIXL_EARLY_KV_LOAD": "0"}) is False
    assert early({**DECODE_CPU, "KIT_NIXL_EARLY_KV_LOAD": "1"}) is True
    assert early({k: v for k, v in DECODE_CPU.items() if k != "KIT_NIXL_EARLY_KV_LOAD"}) is False


@pytest.mark.parametrize(
    ("value", "eager"),
    [
        ("", False),
        ("0", False),
        ("false", False),
        ("OFF", False),
        (" 1 ", True),
        ("true", True),
        ("On", True),
    ],
)
def test_enforce_eager_switch(value, eager) -> None:
    cmd = command.vllm_command(["--port", "1"], {**PREFILL, "KIT_ENFORCE_EAGER": value}, "py")
    assert ("--enforce-eager" in cmd) is eager, cmd
    assert switches.enforce_eager({"KIT_ENFORCE_EAGER": value}) is eager


def test_enforce_eager_unset_is_off_and_never_doubled() -> None:
    assert "--enforce-eager" not in command.vllm_command([], PREFILL, "py")
    argv = ["--enforce-eager"]
    cmd = command.vllm_command(argv, {**PREFILL, "KIT_ENFORCE_EAGER": "1"}, "py")
    assert cmd.count("--enforce-eager") == 1


@pytest.mark.parametrize("value", ["yes", "2", "enabled", "0n"])
def test_enforce_eager_refuses_other_values(value) -> None:
    with pytest.raises(ValueError, match="ENFORCE_EAGER"):
        command.vllm_command([], {**PREFILL, "KIT_ENFORCE_EAGER": value}, "py")


@pytest.mark.parametrize(
    ("previous", "crashed", "ran_s", "want"),
    [
        (0, True, 5.0, 1),
        (2, True, 5.0, 3),  # a third quick crash in a row: the bound
        (2, True, crash_loop.CRASH_RESET_S, 1),  # after a long run: a new series
        (2, False, 5.0, 0),  # a stop asked for (compose stop, engine shutdown) clears it
    ],
)
def test_crash_count(previous, crashed, ran_s, want) -> None:
    assert crash_loop.next_crash_count(previous, crashed, ran_s) == want


def test_crash_record_survives_garbage(tmp_path) -> None:
    path = tmp_path / "sub" / "crashes.json"
    assert crash_loop.read_crashes(path) == (0, "")
    crash_loop.write_crashes(path, 2, "vLLM exited with 1")
    assert crash_loop.read_crashes(path) == (2, "vLLM exited with 1")
    path.write_text("{not json")
    assert crash_loop.read_crashes(path) == (0, "")


def test_supervise_counts_unasked_exits_and_a_stop_clears_them(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(supervise.signal, "signal", lambda *args: None)  # keep pytest's handlers
    crashes = tmp_path / "crashes.json"
    crash = [sys.executable, "-c", "raise SystemExit(0)"]  # vLLM's API server after its engine died
    for want in (1, 2):
        assert supervise.supervise(crash, dict(os.environ), crash_file=crashes) == 1
        assert crash_loop.read_crashes(crashes) == (want, "vLLM exited with 0")
    runner = (
        "import os, signal, sys, threading, time\n"
        f"sys.path.insert(0, {str(ENTRYPOINT_DIR)!r})\n"
        "from vllm_serve.supervise import supervise\n"
        f"{STOP_WHEN_SUPERVISING}"
        "threading.Thread(target=stop_when_supervising, daemon=True).start()\n"
        "cmd = [sys.executable, '-c', 'import time; time.sleep(30)']\n"
        f"sys.exit(supervise(cmd, dict(os.environ), crash_file=__import__('pathlib')"
        f".Path({str(crashes)!r})))\n"
    )
    stopped = subprocess.run([sys.executable, "-c", runner], capture_output=True, timeout=60)
    assert stopped.returncode in (0, 143), stopped.stderr
    assert crash_loop.read_crashes(crashes) == (0, "")


def test_after_the_crash_limit_the_container_waits_without_vllm(tmp_path) -> None:
    """Run as the container runs it: with CRASH_LIMIT unasked exits recorded, vLLM is not
    started (the settings here would be refused, so reaching them would exit 2); the process
    stays up until stopped, then exits 0 and clears the count for the next start."""
    crashes = tmp_path / "crashes.json"
    crash_loop.write_crashes(crashes, crash_loop.CRASH_LIMIT, "vLLM exited with 1")
    proc = subprocess.Popen(
        [sys.executable, str(PACKAGE), "--model", "m"],
        env={"PATH": "/usr/bin:/bin", "KIT_CRASH_FILE": str(crashes)},
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stderr.readline()
        assert "3 unasked exits in a row (last: vLLM exited with 1)" in line, line
        assert "not starting vLLM again" in line
        assert proc.poll() is None
        proc.terminate()
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
        proc.wait()
    assert crash_loop.read_crashes(crashes) == (0, "")
