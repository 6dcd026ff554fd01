"""The live compose project the tests drive: its `docker compose` calls and its teardown."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from pcp_pd_kit.localstack.live import prefill_view, wait_for_scrape_after
from pcp_pd_kit.localstack.report import PrefillView
from tests.support.paths import REPO

PROJECT = "pcp-pd-kit-test"
UP_TIMEOUT_S = 600
# What the docs say: `up -d` (not --wait: one replica waiting for a slot must not block it), then
# the proxy's /health is the readiness (ComposeStack.up); an env file so .env is never read.
UP = ["--profile", "cpu", "up", "-d"]


@dataclass
class ComposeStack:
    env: dict[str, str]
    api_key: str
    proxy_url: str
    prometheus_url: str
    up_seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    def compose(self, *args: str, timeout: float = 120, check: bool = True) -> str:
        argv = self._argv(*args)
        proc = subprocess.run(
            argv, cwd=REPO, env=self.env, capture_output=True, text=True, timeout=timeout
        )
        if check and proc.returncode != 0:
            raise AssertionError(
                f"{' '.join(argv)} exited {proc.returncode}:\n{proc.stderr[-3000:]}"
            )
        return proc.stdout + proc.stderr

    def up(self, timeout_s: float = UP_TIMEOUT_S, prefills: int = 1) -> str:
        """`up -d`, then wait until the proxy's /health answers 200 with at least ``prefills``
        healthy prefill backends (the stack's readiness); compose's output. AssertionError when
        `up` fails, or with the last /health answer when ``timeout_s`` passes first."""
        deadline = time.monotonic() + timeout_s
        out = self.compose(*UP, timeout=timeout_s + 120)  # a refused `up` fails at once
        last = "no answer"
        while time.monotonic() < deadline:
            code, body = self.health()
            last = f"{code} {body}"
            if code == 200 and sum(json.loads(body).get("prefill", {}).values()) >= prefills:
                return out
            time.sleep(2)
        raise AssertionError(
            f"the proxy's /health was not ready with {prefills} prefill(s) within "
            f"{timeout_s:.0f}s: {last}\n{out[-2000:]}"
        )

    def health(self) -> tuple[int, str]:
        """The proxy's GET /health (always open, no key): (status, body); (0, why) unanswered."""
        try:
            with urllib.request.urlopen(f"{self.proxy_url}/health", timeout=5) as resp:
                return resp.status, resp.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()
        except OSError as exc:
            return 0, str(exc)

    def rendered(self) -> dict[str, Any]:
        """The cpu profile as the real Compose binary resolves it for this stack's env."""
        argv = self._argv("--profile", "cpu", "config", "--format", "json")
        proc = subprocess.run(
            argv, cwd=REPO, env=self.env, capture_output=True, text=True, timeout=60, check=True
        )
        return dict(json.loads(proc.stdout))

    @staticmethod
    def _argv(*args: str) -> list[str]:
        """`docker compose` with the documented defaults as its env file, then ``args``."""
        return ["docker", "compose", "--env-file", str(REPO / ".env.example"), *args]

    def server_json(
        self, service: str, path: str, body: dict[str, Any] | None = None, timeout: float = 180
    ) -> Any:
        """A vLLM server's own answer, asked inside its container (the servers are published
        nowhere), with their generated API key; GET when ``body`` is None."""
        port = {"prefill-cpu": 8100, "decode-cpu": 8200}[service]
        script = (
            "import json, sys, urllib.request\n"
            "key = open('/run/kit-keys/vllm_api_key').read().strip()\n"
            "data = sys.stdin.buffer.read() or None\n"
            f"req = urllib.request.Request('http://127.0.0.1:{port}{path}', data=data,"
            " headers={'Content-Type': 'application/json', 'Authorization': 'Bearer ' + key})\n"
            f"print(urllib.request.urlopen(req, timeout={timeout}).read().decode())\n"
        )
        proc = subprocess.run(
            ["docker", "compose", "--env-file", str(REPO / ".env.example"), "exec", "-T"]
            + [service, "python3", "-c", script],
            cwd=REPO,
            env=self.env,
            input="" if body is None else json.dumps(body),
            text=True,
            capture_output=True,
            timeout=timeout + 60,
            check=True,
        )
        return json.loads(proc.stdout) if body is not None else proc.stdout

    def container_state(self, service: str) -> tuple[str, str, int]:
        """(container id, start time, restart count): equal before and after means untouched."""
        cid = self.compose("ps", "-q", service).strip()
        fmt = "{{.State.StartedAt}} {{.RestartCount}}"
        out = subprocess.run(
            ["docker", "inspect", "--format", fmt, cid],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout.split()
        return cid, out[0], int(out[1])

    def logs(self, service: str, tail: int | str = 40) -> str:
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


def settled_prefill_view(stack: ComposeStack, timeout_s: float) -> tuple[PrefillView, float]:
    """The prefill job's view in the Prometheus container once prefill holds no KV and every
    finished request was counted, read from a scrape taken after this call began (so not a
    sample from before the caller's last request); (view, seconds it took). After timeout_s the
    last view is returned as it is, for the caller's checks to report."""
    start = time.time()
    wait_for_scrape_after(stack.prometheus_url, "prefill", start, timeout_s=timeout_s)
    deadline = time.monotonic() + timeout_s
    while True:
        view = prefill_view(stack.prometheus_url)
        settled = view.kv_usage == 0 and (view.canonical or 0) >= (view.held or 0)
        if settled or time.monotonic() > deadline:
            return view, time.time() - start
        time.sleep(1)
