"""The live compose project the tests drive: its `docker compose` calls and its teardown."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass, field

from tests.support.paths import REPO

PROJECT = "pcp-pd-kit-test"
UP_TIMEOUT_S = 600
# What the README says, plus an env file so the developer's .env is never read.
UP = ["--profile", "cpu", "up", "-d", "--wait", "--wait-timeout", str(UP_TIMEOUT_S)]


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
