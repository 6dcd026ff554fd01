"""scripts/compose_up.sh with a fake `docker` on PATH and a real HTTP server as the proxy's
published /health: it is ready when the proxy is, says which containers are not, and on a
failure names every container that is not healthy, with its logs, and cleans up. No engine
needed; the live cases are in tests/compose_live/test_bad_input.py."""

from __future__ import annotations

import os
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.support.fake_bin import write_executable
from tests.support.paths import REPO

SCRIPT = REPO / "scripts" / "compose_up.sh"
SERVICES = ("decode-cpu", "keygen", "prefill-cpu", "prometheus", "proxy-cpu")
PROXY_DOWN = '{"status": "unavailable", "down": ["http://172.29.0.5:8100"]}'

# Containers in $FAKE_DIR/states, "service name state health" a line; a service without a line
# has no container. `up` exits $FAKE_UP_EXIT; `port` prints $FAKE_PORT (none: no port yet). Its
# `logs` drains stdin, as a program that reads its input may: the script must give it none.
FAKE_DOCKER = r"""#!/usr/bin/env bash
set -u
d="${FAKE_DIR:?}"
printf '%s\n' "$*" >>"$d/calls"
last="${!#}"
case "$1" in
  info) exit 0 ;;
  compose)
    case "$*" in
      *" version"*) echo "Docker Compose version v2.40.3" ;;
      *" up "*) exit "${FAKE_UP_EXIT:-0}" ;;
      *"config --services"*) printf '%s\n' __SERVICES__ ;;
      *" port "*) [ -n "${FAKE_PORT:-}" ] || exit 1; echo "$FAKE_PORT" ;;
      *"{{.ExitCode}}"*) echo "${FAKE_KEYGEN_EXIT:-0}" ;;
      *" ps "*) grep "^$last " "$d/states" | cut -d' ' -f2- ;;
      *" logs "*) cat >/dev/null; echo "log line of $last" ;;
      *" down "*) : ;;
      *) echo "fake docker: unexpected compose call: $*" >&2; exit 64 ;;
    esac ;;
  *) echo "fake docker: unexpected: $*" >&2; exit 64 ;;
esac
"""


class Health:
    """The proxy's /health as the script sees it: a status and a body the test sets."""

    def __init__(self) -> None:
        self.status, self.body, self.asked = 503, PROXY_DOWN, 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                outer.asked += 1
                data = outer.body.encode()
                code = outer.status if self.path == "/health" else 404
                self.send_response(code)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                return None

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture
def health() -> Iterator[Health]:
    h = Health()
    yield h
    h.server.shutdown()
    h.server.server_close()


def run_script(
    tmp_path: Path,
    states: str,
    *,
    port: str = "",
    up_exit: int = 0,
    keygen_exit: int = 0,
    timeout_s: int = 2,
) -> subprocess.CompletedProcess[str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    write_executable(bin_dir / "docker", FAKE_DOCKER.replace("__SERVICES__", " ".join(SERVICES)))
    (tmp_path / "states").write_text(states)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", FAKE_DIR=str(tmp_path))
    env.pop("KEEP_ON_FAILURE", None)
    env.update(
        FAKE_KEYGEN_EXIT=str(keygen_exit),
        FAKE_UP_EXIT=str(up_exit),
        FAKE_PORT=port,
        UP_TIMEOUT_S=str(timeout_s),
        UP_POLL_S="0.2",
    )
    return subprocess.run(
        ["bash", str(SCRIPT), "--profile", "cpu"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def named(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("--- ")]


def calls(tmp_path: Path) -> str:
    return (tmp_path / "calls").read_text()


HEALTHY = (
    "decode-cpu p-decode-cpu-1 running healthy\nkeygen p-keygen-1 exited\n"
    "prefill-cpu p-prefill-cpu-1 running healthy\nprometheus p-prometheus-1 running healthy\n"
    "proxy-cpu p-proxy-cpu-1 running healthy\n"
)


def test_ready_when_the_proxy_health_answers_200(tmp_path: Path, health: Health) -> None:
    """`up -d` (never --wait), then the published /health: 200 is ready, nothing to name."""
    health.status, health.body = 200, '{"status": "ok"}'
    proc = run_script(tmp_path, HEALTHY, port=f"0.0.0.0:{health.port}")
    assert proc.returncode == 0, proc.stderr
    assert f"ready: http://127.0.0.1:{health.port}/health answered 200" in proc.stderr
    assert named(proc.stderr) == [] and "not ready" not in proc.stderr
    up = [line for line in calls(tmp_path).splitlines() if " up " in f" {line} "]
    assert up == ["compose --profile cpu up -d"], up
    assert " down " not in calls(tmp_path)


def test_one_replica_never_healthy_but_the_proxy_is_so_up_succeeds_and_names_it(
    tmp_path: Path, health: Health
) -> None:
    """A second prefill waiting for a slot (or held after a crash loop) no longer blocks `up`:
    the proxy serves with the first, and the script says which replica is not ready."""
    health.status, health.body = 200, '{"status": "ok", "down": ["http://172.29.0.6:8100"]}'
    states = HEALTHY + "prefill-cpu p-prefill-cpu-2 running unhealthy\n"
    proc = run_script(tmp_path, states, port=f"127.0.0.1:{health.port}")
    assert proc.returncode == 0, proc.stderr
    assert "serving; not ready (yet)" in proc.stderr
    assert named(proc.stderr) == ["--- prefill-cpu p-prefill-cpu-2 (running unhealthy)"]
    assert "log line of" not in proc.stderr  # names only: nothing failed
    assert " down " not in calls(tmp_path)


def test_a_proxy_that_never_gets_ready_is_a_bounded_failure_with_the_diagnosis(
    tmp_path: Path, health: Health
) -> None:
    states = (
        "decode-cpu p-decode-cpu-1 running starting\nkeygen p-keygen-1 exited\n"
        "prefill-cpu p-prefill-cpu-1 restarting starting\n"
        "prometheus p-prometheus-1 running healthy\nproxy-cpu p-proxy-cpu-1 running starting\n"
    )
    proc = run_script(tmp_path, states, port=f"127.0.0.1:{health.port}", timeout_s=1)
    assert proc.returncode == 1, proc.stderr
    assert health.asked >= 1
    assert "did not get ready within UP_TIMEOUT_S=1s" in proc.stderr
    assert f"503 {PROXY_DOWN}" in proc.stderr  # the proxy's own reason
    assert named(proc.stderr) == [
        "--- decode-cpu p-decode-cpu-1 (running starting)",
        "--- prefill-cpu p-prefill-cpu-1 (restarting starting)",
        "--- proxy-cpu p-proxy-cpu-1 (running starting)",
    ], proc.stderr
    for service in ("decode-cpu", "prefill-cpu", "proxy-cpu"):
        assert f"log line of {service}" in proc.stderr
    assert "removing what was started" in proc.stderr
    assert " down --remove-orphans" in calls(tmp_path)


def test_no_published_port_is_waited_on_then_told(tmp_path: Path) -> None:
    """A proxy restarting has no port yet: the script keeps asking, then says so."""
    proc = run_script(tmp_path, HEALTHY, port="", timeout_s=1)
    assert proc.returncode == 1, proc.stderr
    assert "no published port" in proc.stderr
    assert calls(tmp_path).count(" port proxy-cpu 8000") >= 2


@pytest.mark.parametrize(
    "prefill", ["restarting starting", "exited", "running unhealthy", "created"]
)
def test_up_failing_names_every_container_that_is_not_healthy_with_its_logs(
    tmp_path: Path, prefill: str
) -> None:
    states = (
        "decode-cpu p-decode-cpu-1 running starting\nkeygen p-keygen-1 exited\n"
        f"prefill-cpu p-prefill-cpu-1 {prefill}\nprometheus p-prometheus-1 running healthy\n"
        "proxy-cpu p-proxy-cpu-1 created\n"
    )
    proc = run_script(tmp_path, states, up_exit=1)
    state, _, health = prefill.partition(" ")
    assert proc.returncode == 1, proc.stderr
    assert "docker compose exited 1" in proc.stderr
    assert named(proc.stderr) == [
        "--- decode-cpu p-decode-cpu-1 (running starting)",
        f"--- prefill-cpu p-prefill-cpu-1 ({state} {health})",
        "--- proxy-cpu p-proxy-cpu-1 (created )",
    ], proc.stderr
    for service in ("decode-cpu", "prefill-cpu", "proxy-cpu"):
        assert f"log line of {service}" in proc.stderr
    assert " port " not in calls(tmp_path)  # no /health wait after a failed `up`
    assert "removing what was started" in proc.stderr
    assert " down --remove-orphans" in calls(tmp_path)


def test_a_service_without_a_container_is_named_not_skipped(tmp_path: Path) -> None:
    """A `ps` that has no line for a server (a restart in flight) names it all the same."""
    states = (
        "decode-cpu p-decode-cpu-1 exited\nkeygen p-keygen-1 exited\n"
        "prometheus p-prometheus-1 running healthy\nproxy-cpu p-proxy-cpu-1 created\n"
    )
    proc = run_script(tmp_path, states, up_exit=1)
    assert "--- prefill-cpu - (no container )" in named(proc.stderr), proc.stderr
    assert "log line of prefill-cpu" in proc.stderr


def test_a_keygen_that_refused_is_named_with_its_reason(tmp_path: Path) -> None:
    """keygen exited 2 (a proxy published beyond loopback without keys): its log is the reason
    `up` stopped, so it is shown; an exit 0 keygen is its success and is skipped (above)."""
    states = "keygen p-keygen-1 exited\nprometheus p-prometheus-1 running healthy\n"
    proc = run_script(tmp_path, states, up_exit=1, keygen_exit=2)
    assert "--- keygen p-keygen-1 (exited )" in named(proc.stderr), proc.stderr
    assert "log line of keygen" in proc.stderr


def test_a_bad_timeout_is_refused_before_anything_starts() -> None:
    env_bad = subprocess.run(
        ["bash", str(SCRIPT)],
        env=dict(os.environ, UP_TIMEOUT_S="soon"),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert env_bad.returncode == 2
    assert "UP_TIMEOUT_S=soon: want whole seconds" in env_bad.stderr
