"""The vLLM containers' entrypoint (compose/entrypoint/vllm_serve.py) loaded by path: it is no
package, and the compose and Kubernetes checks call its pure functions to get the argv a container
really execs (the --kv-transfer-config is built there, from the environment)."""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

from tests.support.paths import COMPOSE_DIR

PATH = COMPOSE_DIR / "entrypoint" / "vllm_serve.py"
# Where compose and the pods mount it (compose.yaml x-vllm-common, deploy/k8s/base).
CONTAINER_PATH = "/opt/pcp-pd-kit/entrypoint/vllm_serve.py"


@functools.cache
def entrypoint() -> ModuleType:
    spec = importlib.util.spec_from_file_location("kit_vllm_serve", PATH)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def runs_entrypoint(argv: list[str]) -> bool:
    """Whether a container's argv starts the kit's entrypoint (python3 <its path>)."""
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
    serve = entrypoint()
    # The CPU topology flags do not depend on which cores the container has, only on how many
    # ranks: give it one core per rank.
    ranks = env.get(serve.CPU_PCP_ENV, "").strip()
    cores = list(range(int(ranks))) if ranks.isdigit() and int(ranks) > 0 else [0]
    flags, _ = serve.cpu_topology(env, cores)
    return list(serve.vllm_command([*argv[2:], *flags], env, argv[0]))


def main_env(monkeypatch: Any, tmp_path: Path, env: Mapping[str, str]) -> None:
    """The process environment a test's ``main()`` runs in: ``env``, a crash file in
    ``tmp_path``, and no HF token or vLLM key file (the container's secrets are absent)."""
    serve = entrypoint()
    for key, value in {"KIT_CRASH_FILE": str(tmp_path / "crashes.json"), **env}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(serve, "HF_TOKEN_FILE", tmp_path / "absent")
    monkeypatch.setattr(serve, "VLLM_KEY_FILE", tmp_path / "absent")
