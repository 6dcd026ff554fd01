"""The Docker engine restarts under the running cpu stack, as a host reboot does: every service
comes back by itself (no `compose up`), the servers rejoin the new holder's namespaces, and a
service stopped by hand stays stopped.

Only where the kit started the engine itself (scripts/docker_engine.sh keeps dockerd's PID in
run/docker-engine/): an engine of the user's own (systemd, Docker Desktop) is not the tests' to
stop. Runs after test_cpu_deployment.py and before the faults on the same session stack (files
run in name order); it waits until every service is healthy again, so they start from a serving
stack. About 2 minutes on 2 cores (most of it the two vLLM servers starting again).
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from tests.support.paths import REPO

from .stack import ComposeStack
from .test_cpu_deployment import PROMPTS, greedy_body, http, text_of

pytestmark = [pytest.mark.compose, pytest.mark.slow]
ENGINE_SCRIPT = REPO / "scripts" / "docker_engine.sh"
PID_FILE = REPO / "run" / "docker-engine" / "dockerd.pid"
SERVICES = ("holder", "prefill-cpu", "decode-cpu", "proxy-cpu", "prometheus")
BACK_WITHIN_S = 420


def kit_dockerd() -> int | None:
    """dockerd's PID when scripts/docker_engine.sh started the engine that answers, else None."""
    try:
        pid = int(PID_FILE.read_text().strip())
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
    except (OSError, ValueError):
        return None
    return pid if comm == "dockerd" else None


def engine(action: str) -> None:
    proc = subprocess.run(
        ["bash", str(ENGINE_SCRIPT), action], capture_output=True, text=True, timeout=180
    )
    assert proc.returncode == 0, f"docker_engine.sh {action}: {proc.stderr[-2000:]}"


def inspect(cid: str, fmt: str) -> str:
    return subprocess.run(
        ["docker", "inspect", "--format", fmt, cid],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout.strip()


def namespaces(pid: str) -> tuple[str, str]:
    return os.readlink(f"/proc/{pid}/ns/ipc"), os.readlink(f"/proc/{pid}/ns/pid")


def healthy_or_running(stack: ComposeStack) -> dict[str, str]:
    out = stack.compose(
        "--profile", "cpu", "ps", "-a", "--format", "{{.Service}} {{.State}} {{.Health}}"
    )
    states = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0] in SERVICES:
            states[parts[0]] = " ".join(parts[1:])
    return states


def wait_serving(stack: ComposeStack, want: str, start: float) -> float:
    url = f"{stack.proxy_url}/v1/completions"
    body = greedy_body(PROMPTS["short"])
    last: object = None
    while time.monotonic() - start < BACK_WITHIN_S:
        try:
            status, answer = http(url, body, key=stack.api_key, timeout=60)
        except OSError as exc:  # the proxy's port is not published again yet
            status, answer = 0, {"error": str(exc)}
        if status == 200:
            assert text_of(answer) == want
            return time.monotonic() - start
        last = (status, answer)
        time.sleep(3)
    states = healthy_or_running(stack)
    logs = "\n".join(f"--- {s}\n{stack.logs(s)}" for s in ("prefill-cpu", "decode-cpu"))
    raise AssertionError(f"no 200 within {BACK_WITHIN_S}s: {last}; {states}\n{logs}")


def test_every_service_comes_back_after_an_engine_restart(compose_stack) -> None:
    pid = kit_dockerd()
    if pid is None:
        pytest.skip(
            "the Docker engine here was not started by scripts/docker_engine.sh (no live dockerd "
            f"PID in {PID_FILE.relative_to(REPO)}): stopping an engine of the user's own would "
            "stop everything else it runs, so the engine-restart check runs only on the kit's"
        )
    stack = compose_stack
    url = f"{stack.proxy_url}/v1/completions"
    body = greedy_body(PROMPTS["short"])
    status, answer = http(url, body, key=stack.api_key, timeout=120)
    assert status == 200, answer
    want = text_of(answer)
    ids = {s: stack.compose("ps", "-a", "-q", s).strip() for s in SERVICES}
    # A service stopped by hand must stay stopped across the restart (unless-stopped).
    stack.compose("stop", "prometheus", timeout=120)

    start = time.monotonic()
    engine("stop")  # SIGTERM to dockerd, as a reboot's shutdown does
    assert kit_dockerd() is None
    engine("ensure")
    served_s = wait_serving(stack, want, start)
    print(f"\nserving again {served_s:.0f}s after the engine stop (no `compose up`)")

    # The same containers, started by the engine itself; the servers in the new holder's
    # namespaces (the holder's process is new, so are its namespaces).
    assert {s: stack.compose("ps", "-a", "-q", s).strip() for s in SERVICES} == ids
    holder_pid = inspect(ids["holder"], "{{.State.Pid}}")
    for server in ("prefill-cpu", "decode-cpu"):
        server_pid = inspect(ids[server], "{{.State.Pid}}")
        assert namespaces(server_pid) == namespaces(holder_pid), server
    stopped = inspect(ids["prometheus"], "{{.State.Status}}")
    assert stopped == "exited", f"prometheus, stopped by hand, came back: {stopped}"

    stack.compose("start", "prometheus", timeout=120)
    deadline = time.monotonic() + 180
    while True:
        states = healthy_or_running(stack)
        if all(
            states.get(s, "").endswith("healthy") and "unhealthy" not in states.get(s, "")
            for s in SERVICES
            if s != "holder"
        ):
            break
        assert time.monotonic() < deadline, f"not every service healthy again: {states}"
        time.sleep(3)
    print(f"every service healthy {time.monotonic() - start:.0f}s after the engine stop")
