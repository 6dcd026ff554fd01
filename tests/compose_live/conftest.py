"""The compose CPU deployment started for real, with the README's command, once per session.

`make test` has made a Docker engine, the Compose plugin and the images available
(scripts/docker_engine.sh, scripts/images.sh). The stack runs under its own project name, on free
host ports, with a secrets folder of its own (a client key) and `.env.example` as its env file,
so it neither reads the developer's `.env` nor touches a stack the developer is running. It is
torn down with `down -v` even when a test fails, and the teardown is checked.
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PROJECT = "pcp-pd-kit-test"
UP_TIMEOUT_S = 600
# What the README says, plus an env file so the developer's .env is never read.
UP = ["--profile", "cpu", "up", "-d", "--wait", "--wait-timeout", str(UP_TIMEOUT_S)]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class ComposeStack:
    env: dict[str, str]
    api_key: str
    proxy_url: str
    prometheus_url: str
    up_seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    def compose(self, *args: str, timeout: float = 120, check: bool = True) -> str:
        argv = ["docker", "compose", "--env-file", str(REPO / ".env.example"), *args]
        proc = subprocess.run(
            argv, cwd=REPO, env=self.env, capture_output=True, text=True, timeout=timeout
        )
        if check and proc.returncode != 0:
            raise AssertionError(
                f"{' '.join(argv)} exited {proc.returncode}:\n{proc.stderr[-3000:]}"
            )
        return proc.stdout + proc.stderr

    def logs(self, service: str, tail: int = 40) -> str:
        return self.compose("logs", "--no-color", "--tail", str(tail), service, check=False)

    def project_objects(self) -> dict[str, list[str]]:
        """Containers, networks and volumes Docker still holds for the test project."""
        label = f"label=com.docker.compose.project={PROJECT}"
        out = {}
        for kind in ("container", "network", "volume"):
            extra = ["-a"] if kind == "container" else []
            proc = subprocess.run(
                ["docker", kind, "ls", *extra, "-q", "--filter", label],
                capture_output=True,
                text=True,
                timeout=30,
                check=True,
            )
            out[kind] = proc.stdout.split()
        return out


def compose_down(env: dict[str, str], grace_s: int = 30) -> None:
    """`down -v` of the cpu profile for the project ``env`` names; never raises (a teardown)."""
    subprocess.run(
        [
            "docker",
            "compose",
            "--env-file",
            str(REPO / ".env.example"),
            "--profile",
            "cpu",
            "down",
            "-v",
            "--remove-orphans",
            "--timeout",
            str(grace_s),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        timeout=300,
        check=False,
    )


def _docker_ready() -> str | None:
    if shutil.which("docker") is None:
        return "no docker CLI on PATH"
    if subprocess.run(["docker", "info"], capture_output=True, timeout=30).returncode != 0:
        return "no Docker engine answers (scripts/docker_engine.sh ensure starts one)"
    if subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30).returncode:
        return "the Compose v2 plugin is missing (scripts/docker_engine.sh ensure installs it)"
    missing = [
        image
        for image in (
            "pcp-pd-kit/vllm-cpu:v0.32.0",
            "pcp-pd-kit/pd-proxy:0.1.0",
            "pcp-pd-kit/prometheus:v3.5.0",
        )
        if subprocess.run(["docker", "image", "inspect", image], capture_output=True).returncode
    ]
    if missing:
        return f"images {missing} are missing: run `make images`"
    return None


@pytest.fixture(scope="session")
def compose_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ComposeStack]:
    problem = _docker_ready()
    if problem:
        pytest.fail(f"the live compose tests need Docker: {problem}")
    secrets_dir = tmp_path_factory.mktemp("secrets")
    api_key = "sk-test-" + secrets.token_urlsafe(16)
    (secrets_dir / "api_keys").write_text(f"# test key\n{api_key}\n")
    # As secrets/README.md says (umask 077): keygen must stage it for the proxy's uid 10001.
    secrets_dir.chmod(0o700)
    (secrets_dir / "api_keys").chmod(0o600)
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("COMPOSE_", "PD_PROXY_", "KIT_"))
    }
    proxy_port, prom_port = free_port(), free_port()
    env.update(
        COMPOSE_PROJECT_NAME=PROJECT,
        COMPOSE_BAKE="false",
        PROXY_BIND_ADDRESS="127.0.0.1",
        PROXY_PORT=str(proxy_port),
        PROMETHEUS_PORT=str(prom_port),
        PREFILL_PORT=str(free_port()),
        DECODE_PORT=str(free_port()),
        KIT_SECRETS_DIR=str(secrets_dir),
        VLLM_START_PERIOD="10m",
        # Not the default subnet, so a deployment of the user's own can run beside the tests.
        PD_SUBNET="172.29.251.0/24",
    )
    stack = ComposeStack(
        env=env,
        api_key=api_key,
        proxy_url=f"http://127.0.0.1:{proxy_port}",
        prometheus_url=f"http://127.0.0.1:{prom_port}",
    )
    compose_down(env)  # leftovers of an interrupted earlier run
    start = time.monotonic()
    try:
        out = stack.compose(*UP, timeout=UP_TIMEOUT_S + 120, check=False)
        stack.up_seconds = time.monotonic() - start
        if "Error" in out and "Healthy" not in out or _unhealthy(stack):
            logs = "\n".join(
                f"--- {name}\n{stack.logs(name)}"
                for name in ("prefill-cpu", "decode-cpu", "proxy-cpu", "prometheus", "keygen")
            )
            pytest.fail(
                f"`docker compose {' '.join(UP)}` did not get healthy:\n{out[-2000:]}\n{logs}"
            )
        yield stack
    finally:
        compose_down(env)


def _unhealthy(stack: ComposeStack) -> bool:
    status = stack.compose(
        "--profile", "cpu", "ps", "--format", "{{.Service}} {{.Health}}", check=False
    )
    wanted = {"prefill-cpu", "decode-cpu", "proxy-cpu", "prometheus"}
    healthy = {line.split()[0] for line in status.splitlines() if line.endswith(" healthy")}
    return not wanted <= healthy
