"""Command line: parse the arguments, run the checks in order (later checks use what earlier ones
found), print one line per result or --json, and exit with the number of FAILs."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from pcp_pd_kit import repo_root
from pcp_pd_kit.preflight import (
    check_cdi,
    check_disk,
    check_docker,
    check_driver,
    check_gpu,
    check_memory,
    check_model,
    check_moe,
    check_ports,
    check_profile,
    check_subnet,
    check_timeouts,
    check_transport,
    check_vllm,
    report,
)
from pcp_pd_kit.preflight.context import Context
from pcp_pd_kit.preflight.report import Result

REPO = repo_root()
USAGE_ERROR = 100

DESCRIPTION = """\
Checks a GPU host before `docker compose up`: Docker Compose v2, the NVIDIA runtime, the GPUs
named by PREFILL_GPUS/DECODE_GPUS (each replica's share, with PREFILL_REPLICAS/DECODE_REPLICAS),
the MoE backend for their compute capability, ENFORCE_EAGER,
GPU memory for the weights, the driver for the image's CUDA, NIXL in the image, CDI devices for
compose's GPU requests, PD_SUBNET, free disk, the model and its token, free host ports, the
KV lease against pd-proxy's timeouts, and one vLLM release for prefill and decode.
Settings are the ones Compose resolves from compose.yaml's x-kit-settings (environment > env
file > defaults). Each result is one line, ok/WARN/FAIL, and
every FAIL names the fix; the exit status is the number of FAILs (at most 100).
"""
EPILOG = """\
COMPOSE_PROFILES=cpu (or --profile cpu) skips the GPU checks. Test hooks: PREFLIGHT_DOCKER,
PREFLIGHT_NVIDIA_SMI, PREFLIGHT_NVIDIA_CTK and PREFLIGHT_IP name the commands to call,
PREFLIGHT_DAEMON_PATH where dockerd finds the NVIDIA hooks, PREFLIGHT_COMPOSE_FILE the compose
file. See docs/preflight.md.
"""
#: The checks in dependency order (later ones read what earlier ones found), each with the Context
#: flag an earlier check must have set for it to run ("" = always). WITH_SETTINGS read
#: compose.yaml's settings and run only when they loaded.
BEFORE_SETTINGS = (
    (check_docker.compose, ""), (check_docker.load_settings, "compose_ok"),
    (check_profile.choose_mode, ""), (check_docker.daemon, "docker_found"),
    (check_gpu.inventory, "gpu_mode"),
)  # fmt: skip
WITH_SETTINGS = (
    (check_moe.moe_backend, "gpu_mode"), (check_moe.enforce_eager, "gpu_mode"),
    (check_memory.gpu_memory, "gpu_mode"), (check_driver.driver_cuda, "gpu_mode"),
    (check_docker.nixl, "gpu_mode"), (check_transport.kv_transport, "gpu_mode"),
    (check_cdi.cdi, "gpu_mode"), (check_subnet.subnet, ""),
    (check_disk.disk, ""), (check_model.model, ""), (check_model.secret_files, ""),
    (check_ports.ports, ""), (check_timeouts.kv_timeouts, ""), (check_vllm.same_vllm, ""),
)  # fmt: skip
#: The command line's options.
OPTIONS = (
    ("--env-file", {"type": Path, "metavar": "FILE",
                    "help": "env file Compose reads instead of the repo's .env"}),
    ("--profile", {"action": "append", "default": [], "metavar": "NAME",
                   "help": "Compose profile to check (repeatable; default: COMPOSE_PROFILES)"}),
    ("--json", {"action": "store_true",
                "help": "print a JSON list of {check, status, message} instead of lines"}),
)  # fmt: skip


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        self.print_usage(sys.stderr)
        sys.stderr.write(f"preflight: {message} (see --help)\n")
        sys.exit(USAGE_ERROR)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = _Parser(
        prog="scripts/preflight.sh",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    for flag, options in OPTIONS:
        parser.add_argument(flag, **options)
    return parser.parse_args(argv)


def run_checks(ctx: Context) -> list[Result]:
    """All checks in dependency order; those needing the settings stop if they did not load."""
    results = _run(BEFORE_SETTINGS, ctx)
    if ctx.settings is None:
        msg = (
            "the other checks read compose.yaml's settings, so they did not run: fix the FAIL "
            "lines above, then run scripts/preflight.sh again."
        )
        return results + [report.warn("settings", msg)]
    return results + _run(WITH_SETTINGS, ctx)


def _run(
    checks: Sequence[tuple[Callable[[Context], list[Result]], str]], ctx: Context
) -> list[Result]:
    return [r for check, flag in checks if not flag or getattr(ctx, flag) for r in check(ctx)]


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.env_file is not None and not args.env_file.is_file():
        sys.stderr.write(f"preflight: env file {args.env_file} does not exist\n")
        return USAGE_ERROR
    environ = os.environ
    ctx = Context(
        compose_file=Path(environ.get("PREFLIGHT_COMPOSE_FILE") or REPO / "compose.yaml"),
        env_file=args.env_file,
        profiles=[p for value in args.profile for p in value.split(",") if p],
        docker=environ.get("PREFLIGHT_DOCKER") or "docker",
        nvidia_smi=environ.get("PREFLIGHT_NVIDIA_SMI") or "nvidia-smi",
        ip=environ.get("PREFLIGHT_IP") or "ip",
        environ=environ,
        nvidia_ctk=environ.get("PREFLIGHT_NVIDIA_CTK") or "nvidia-ctk",
        daemon_path=environ.get("PREFLIGHT_DAEMON_PATH") or "",
    )
    results = run_checks(ctx)
    if args.json:
        sys.stdout.write(report.render_json(results))
    else:
        env = f" --env-file {args.env_file}" if args.env_file is not None else ""
        sys.stdout.write(report.render_text(results, f"docker compose{env} up -d"))
    return report.exit_status(results)
