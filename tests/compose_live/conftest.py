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
import subprocess
import time
from collections.abc import Iterator

import pytest

from tests.support.net import free_ports

from .stack import PROJECT, ComposeStack, compose_down


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
    proxy_port, prom_port, prefill_port, decode_port = free_ports(4)
    env.update(
        COMPOSE_PROJECT_NAME=PROJECT,
        COMPOSE_BAKE="false",
        PROXY_BIND_ADDRESS="127.0.0.1",
        PROXY_PORT=str(proxy_port),
        PROMETHEUS_PORT=str(prom_port),
        PREFILL_PORT=str(prefill_port),
        DECODE_PORT=str(decode_port),
        KIT_SECRETS_DIR=str(secrets_dir),
        VLLM_START_PERIOD="10m",
        # Not the default subnet, so a deployment of the user's own can run beside the tests.
        PD_SUBNET="172.29.251.0/24",
        # Every prompt takes the P/D path, short ones too: the checks here read the prefill's
        # work and the KV that crossed NIXL (decode alone has its own tests, tests/e2e).
        LOCAL_PREFILL_MAX_TOKENS="0",
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
        try:
            stack.up()
        except AssertionError as exc:
            pytest.fail(f"{exc}\n{_logs(stack)}")
        stack.up_seconds = time.monotonic() - start
        # Ready means the proxy can serve; every service of the default (one replica each) gets
        # healthy too, within a few of its 5 s health checks.
        deadline = time.monotonic() + 60
        while _unhealthy(stack) and time.monotonic() < deadline:
            time.sleep(2)
        if _unhealthy(stack):
            pytest.fail(f"the proxy was ready but not every service got healthy:\n{_logs(stack)}")
        yield stack
    finally:
        compose_down(env)


def _logs(stack: ComposeStack) -> str:
    return "\n".join(
        f"--- {name}\n{stack.logs(name)}"
        for name in ("prefill-cpu", "decode-cpu", "proxy-cpu", "prometheus", "keygen")
    )


def _unhealthy(stack: ComposeStack) -> bool:
    status = stack.compose(
        "--profile", "cpu", "ps", "--format", "{{.Service}} {{.Health}}", check=False
    )
    wanted = {"prefill-cpu", "decode-cpu", "proxy-cpu", "prometheus"}
    healthy = {line.split()[0] for line in status.splitlines() if line.endswith(" healthy")}
    return not wanted <= healthy


# Marks a live compose test that works whatever the number of prefill replicas (the `down` check).
ANY_PREFILL_REPLICAS = "any_prefill_replicas"


def one_replica_needed(later: list[pytest.Item]) -> bool:
    """Whether a test still to run uses the session stack and expects its one prefill replica
    (every such test not marked ``any_prefill_replicas``)."""
    return any(
        "compose_stack" in item.fixturenames
        and item.get_closest_marker(ANY_PREFILL_REPLICAS) is None
        for item in later
    )


def items_after_module(request: pytest.FixtureRequest) -> list[pytest.Item]:
    """The session's tests after the last one of the requesting module."""
    items = request.session.items
    mine = [i for i, item in enumerate(items) if getattr(item, "module", None) is request.module]
    return items[mine[-1] + 1 :] if mine else list(items)


@pytest.fixture(scope="module")
def two_prefills(
    compose_stack: ComposeStack, request: pytest.FixtureRequest
) -> Iterator[ComposeStack]:
    """PREFILL_REPLICAS=2 through `up` (per test module), back to one replica at the end when a
    later test needs that: scaling back recreates the first prefill (a full start, 1-2 minutes on
    2 cores), which the `down` check alone does not need."""
    one = dict(compose_stack.env)
    compose_stack.env["PREFILL_REPLICAS"] = "2"
    try:
        start = time.monotonic()
        out = compose_stack.up(timeout_s=900, prefills=2)
        names = _prefill_replicas(compose_stack)
        assert len(names) == 2, (names, out[-2000:], compose_stack.logs("prefill-cpu", 60))
        print(f"\nsecond prefill replica healthy {time.monotonic() - start:.0f}s after `up`")
        yield compose_stack
    finally:
        compose_stack.env.clear()
        compose_stack.env.update(one)
        if one_replica_needed(items_after_module(request)):
            try:
                compose_stack.up(timeout_s=900)
            except AssertionError as exc:  # never hide the test's own failure
                print(f"\nback to one prefill replica: {exc}")
        else:
            print("\nno later test needs one prefill replica: left as it is for `down`")


def _prefill_replicas(stack: ComposeStack) -> list[str]:
    out = stack.compose("--profile", "cpu", "ps", "--format", "{{.Name}}", "prefill-cpu")
    return sorted(line.strip() for line in out.splitlines() if line.strip())
