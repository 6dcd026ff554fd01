"""Checks of Docker itself: the CLI and Compose v2, the settings Compose resolves, the daemon and
its NVIDIA runtime, and NIXL inside the vLLM image."""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

from pcp_pd_kit.preflight import proc, settings
from pcp_pd_kit.preflight.context import COMPOSE_S, CONTAINER_S, QUICK_S, Context
from pcp_pd_kit.preflight.cuda import version_tuple
from pcp_pd_kit.preflight.report import Result, fail, ok, warn

#: What vLLM's NIXL connector imports (vllm/distributed/nixl_utils.py), not just `import nixl`.
NIXL_PROBE = "from nixl._api import nixl_agent"


def compose(ctx: Context) -> list[Result]:
    """Docker CLI on PATH and `docker compose` v2; sets ctx.docker_found / ctx.compose_ok."""
    if shutil.which(ctx.docker) is None:
        msg = (
            f"docker is not installed (no '{ctx.docker}' on PATH): install Docker Engine, "
            "https://docs.docker.com/engine/install/."
        )
        return [fail("docker", msg)]
    ctx.docker_found = True
    out = proc.run([ctx.docker, "compose", "version", "--short"], QUICK_S)
    if not out.ok:
        msg = (
            f"Docker Compose v2 plugin missing ('docker compose version' failed: {out.detail()})"
            ": install the docker-compose-plugin package, "
            "https://docs.docker.com/compose/install/linux/."
        )
        return [fail("compose", msg)]
    version = out.stdout.strip().lstrip("v")
    if not version_tuple(version) or version_tuple(version)[0] < 2:
        msg = (
            f"Docker Compose is version '{version}', compose.yaml needs v2 or later: install the "
            "docker-compose-plugin package."
        )
        return [fail("compose", msg)]
    ctx.compose_ok = True
    return [ok("compose", f"Docker Compose {version}")]


def load_settings(ctx: Context) -> list[Result]:
    """Resolve compose.yaml with Compose and read x-kit-settings; sets ctx.view / ctx.settings."""
    if not ctx.compose_file.is_file():
        msg = (
            f"{ctx.compose_file} does not exist, so there are no settings to check: run "
            "preflight from a complete checkout of the kit."
        )
        return [fail("settings", msg)]
    argv = settings.config_argv(ctx.docker, ctx.compose_file, ctx.env_file, ctx.profiles)
    out = proc.run(argv, COMPOSE_S)
    if not out.ok:
        msg = (
            f"'docker compose config' failed ({out.detail()}): fix {ctx.compose_file.name} or "
            f"{ctx.env_label} until it succeeds."
        )
        return [fail("settings", msg)]
    try:
        view = settings.parse_config(out.stdout)
    except settings.SettingsError as exc:
        return [fail("settings", str(exc))]
    ctx.view = view
    ctx.settings = settings.Settings(view.settings, ctx.compose_file.parent, ctx.env_label)
    source = f"environment > {ctx.env_label} > {ctx.compose_file.name} defaults"
    return [ok("settings", f"settings of project '{view.project}' resolved by Compose ({source})")]


def daemon(ctx: Context) -> list[Result]:
    """`docker info` answers, and (GPU stacks) Docker can hand NVIDIA GPUs to containers."""
    out = proc.run([ctx.docker, "info", "--format", "{{json .}}"], QUICK_S)
    info = _json_object(out.stdout) if out.ok else None
    if info is None or info.get("ServerErrors"):  # the CLI answers for itself without a daemon
        msg = (
            "'docker info' failed, so the Docker daemon is not reachable: start it (sudo "
            "systemctl start docker) or add your user to the docker group."
        )
        return [fail("docker-daemon", msg)]
    ctx.info = info
    if not ctx.gpu_mode:
        return [ok("docker-daemon", "Docker daemon reachable")]
    if "nvidia" in (info.get("Runtimes") or {}):
        return [ok("nvidia-runtime", "NVIDIA container runtime registered with Docker")]
    if "nvidia.com/gpu" in json.dumps(info.get("DiscoveredDevices") or []):
        return [ok("nvidia-runtime", "NVIDIA GPUs offered to Docker through CDI (nvidia.com/gpu)")]
    msg = (
        "Docker has neither an NVIDIA runtime nor NVIDIA CDI devices, so containers cannot see "
        "GPUs: install the NVIDIA Container Toolkit and run 'sudo nvidia-ctk runtime configure "
        "--runtime=docker && sudo systemctl restart docker'."
    )
    return [fail("nvidia-runtime", msg)]


def nixl(ctx: Context) -> list[Result]:
    """NIXL imports inside VLLM_IMAGE the way vLLM imports it; only for an image already pulled."""
    image = ctx.need_settings().text("vllm_image")
    if not ctx.image_known():
        return [warn("nixl", f"NIXL in {image} not checked: the Docker daemon is not reachable.")]
    if ctx.image() is None:
        msg = (
            f"{image} is not pulled yet, so NIXL inside it is checked after the pull: run "
            f"'docker pull {image}' and preflight again (preflight never pulls)."
        )
        return [warn("nixl", msg)]
    name = f"kit-preflight-nixl-{os.getpid()}"
    argv = [ctx.docker, "run", "--rm", "--name", name, "--pull", "never", "--network", "none",
            "--entrypoint", "python3", image, "-c", NIXL_PROBE]  # fmt: skip
    out = proc.run(argv, CONTAINER_S)
    if out.timed_out:
        proc.run([ctx.docker, "rm", "-f", name], QUICK_S)  # the CLI died; stop its container
        msg = (
            f"importing NIXL in {image} did not finish in {CONTAINER_S:.0f} s: check that "
            "'docker run' works on this host, then run preflight again."
        )
        return [fail("nixl", msg)]
    if not out.ok:
        msg = (
            f"{image} cannot import NIXL ({out.detail()}), so the KV transfer connector cannot "
            "start: set VLLM_IMAGE to a vLLM image built with NIXL (the vllm/vllm-openai "
            "release images ship it)."
        )
        return [fail("nixl", msg)]
    return [ok("nixl", f"NIXL imports in {image} ({NIXL_PROBE})")]


def _json_object(text: str) -> dict[str, Any] | None:
    try:
        data = json.loads(text)
    except ValueError:
        return None
    return data if isinstance(data, dict) else None
