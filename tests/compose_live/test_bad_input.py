"""Bad input to the compose deployment is a clear error, bounded in time, with nothing left running.

`scripts/compose_up.sh` is `docker compose up -d`, then a bounded wait for the proxy's /health,
plus the diagnosis: each container that did not get healthy, its service's last log lines, then
`down`. Each case runs under its own project name.
"""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.net import free_port
from tests.support.paths import REPO

from .stack import compose_down

pytestmark = pytest.mark.compose
UP = REPO / "scripts" / "compose_up.sh"


def project_containers(project: str) -> list[str]:
    proc = subprocess.run(
        ["docker", "ps", "-aq", "--filter", f"label=com.docker.compose.project={project}"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return proc.stdout.split()


@pytest.fixture
def bad_env(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[dict[str, str]]:
    project = f"pcp-pd-kit-bad-{request.node.name.split('[')[0][-20:].replace('_', '-')}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMPOSE_", "KIT_"))}
    secrets_dir = tmp_path / "secrets"
    secrets_dir.mkdir()
    env.update(
        COMPOSE_PROJECT_NAME=project,
        COMPOSE_BAKE="false",
        PROXY_BIND_ADDRESS="127.0.0.1",
        PROXY_PORT=str(free_port()),
        PROMETHEUS_PORT=str(free_port()),
        KIT_SECRETS_DIR=str(secrets_dir),
        PD_SUBNET="172.29.252.0/24",
    )
    yield env
    compose_down(env, grace_s=10)


def run_up(env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(UP), "--env-file", str(REPO / ".env.example"), "--profile", "cpu"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_no_engine_is_named_at_once(bad_env) -> None:
    bad_env["DOCKER_HOST"] = "unix:///nonexistent/docker.sock"
    proc = run_up(bad_env, timeout=60)
    assert proc.returncode == 2
    assert "no Docker engine answers (DOCKER_HOST=unix:///nonexistent/docker.sock)" in proc.stderr


def test_a_taken_port_names_the_port_and_leaves_nothing_running(bad_env) -> None:
    bad_env["VLLM_START_PERIOD"] = "0s"  # Prometheus fails at once; no need to wait for vLLM
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", int(bad_env["PROMETHEUS_PORT"])))
        taken.listen()
        proc = run_up(bad_env, timeout=300)
    assert proc.returncode != 0
    assert bad_env["PROMETHEUS_PORT"] in proc.stderr
    assert "address already in use" in proc.stderr or "already allocated" in proc.stderr
    assert "removing what was started" in proc.stderr
    assert project_containers(bad_env["COMPOSE_PROJECT_NAME"]) == []


def test_a_server_that_never_gets_healthy_shows_its_last_log_lines(bad_env) -> None:
    bad_env["CPU_MODEL"] = "/models/no-such-model"
    # Long enough for vLLM to print why it cannot start, short enough to keep the test quick.
    bad_env["VLLM_START_PERIOD"] = "45s"
    # The proxy never gets a prefill: a bounded wait, past vLLM's failure (~25 s on 2 cores).
    bad_env["UP_TIMEOUT_S"] = "75"
    proc = run_up(bad_env, timeout=400)
    assert proc.returncode != 0
    named = [line for line in proc.stderr.splitlines() if line.startswith("--- ")]
    assert any(line.startswith("--- prefill-cpu ") for line in named), (named, proc.stderr[-3000:])
    assert "did not get ready within UP_TIMEOUT_S=75s" in proc.stderr, proc.stderr[-3000:]
    assert "no-such-model" in proc.stderr, proc.stderr[-3000:]
    assert project_containers(bad_env["COMPOSE_PROJECT_NAME"]) == []


def test_a_wide_proxy_address_without_keys_stops_up_at_keygen(bad_env) -> None:
    """Closed by default: PROXY_BIND_ADDRESS=0.0.0.0 with an empty secrets folder stops `up`
    before any server starts, with keygen's reason; the explicit opt-out lets keygen pass."""
    bad_env["PROXY_BIND_ADDRESS"] = "0.0.0.0"
    proc = run_up(bad_env, timeout=300)
    assert proc.returncode != 0
    assert "keygen: refusing to start the proxy: PROXY_BIND_ADDRESS=0.0.0.0" in proc.stderr, (
        proc.stderr[-3000:]
    )
    assert project_containers(bad_env["COMPOSE_PROJECT_NAME"]) == []
    opened = subprocess.run(
        ["docker", "compose", "--env-file", str(REPO / ".env.example"), "--profile", "cpu"]
        + ["run", "--rm", "keygen"],
        cwd=REPO,
        env={**bad_env, "PROXY_OPEN_WITHOUT_KEYS": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert opened.returncode == 0, opened.stderr[-2000:]
