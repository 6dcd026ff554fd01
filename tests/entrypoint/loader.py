"""The vLLM containers' entrypoint as the compose and Kubernetes checks use it: what a container
really execs (the --kv-transfer-config is built by the entrypoint, from the environment), and the
process environment a test's ``main()`` runs in."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from vllm_serve import command, cpu_topology, gpus, replica, secret_files

from tests.entrypoint import ENTRYPOINT_DIR

# The package's modules the compose and Kubernetes checks call (their own rules, not copies).
__all__ = [
    "CONTAINER_PATH",
    "PACKAGE",
    "command",
    "cpu_topology",
    "effective_argv",
    "gpus",
    "main_env",
    "replica",
    "runs_entrypoint",
]

PACKAGE = ENTRYPOINT_DIR / "vllm_serve"  # run as a folder: `python3 <PACKAGE> <vLLM flags>`
# Where compose and the pods mount it (compose.yaml x-vllm-common, deploy/k8s/base).
CONTAINER_PATH = "/opt/pcp-pd-kit/entrypoint/vllm_serve"


def runs_entrypoint(argv: list[str]) -> bool:
    """Whether a container's argv starts the kit's entrypoint (python3 <its folder>)."""
    return (
        len(argv) >= 2
        and argv[0].rsplit("/", 1)[-1].startswith("python")
        and (argv[1] == CONTAINER_PATH)
    )


def effective_argv(argv: list[str], env: dict[str, str]) -> list[str]:
    """What a container whose process is ``argv`` finally execs in ``env``: through the kit's
    entrypoint, the vLLM command it builds (its interpreter standing in for sys.executable);
    anything else unchanged. ValueError, with the entrypoint's message, when it would refuse."""
    if not runs_entrypoint(argv):
        return list(argv)
    # The CPU topology flags do not depend on which cores the container has, only on how many
    # ranks: give it one core per rank.
    ranks = env.get(cpu_topology.CPU_PCP_ENV, "").strip()
    cores = list(range(int(ranks))) if ranks.isdigit() and int(ranks) > 0 else [0]
    flags, _ = cpu_topology.cpu_topology(env, cores)
    return list(command.vllm_command([*argv[2:], *flags], env, argv[0]))


def main_env(monkeypatch: Any, tmp_path: Path, env: Mapping[str, str]) -> None:
    """The process environment a test's ``main()`` runs in: ``env``, a crash file in
    ``tmp_path``, and no HF token or vLLM key file (the container's secrets are absent)."""
    for key, value in {"KIT_CRASH_FILE": str(tmp_path / "crashes.json"), **env}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(secret_files, "HF_TOKEN_FILE", tmp_path / "absent")
    monkeypatch.setattr(secret_files, "VLLM_KEY_FILE", tmp_path / "absent")
