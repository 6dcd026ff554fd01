"""Command line: parse the arguments, run the checks in order (later checks use what earlier ones
found), print one line per result or --json, and exit with the number of FAILs."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from pcp_pd_kit import repo_root
from pcp_pd_kit.preflight import (
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
    report,
)
from pcp_pd_kit.preflight.context import Context
from pcp_pd_kit.preflight.report import Result

REPO = repo_root()
USAGE_ERROR = 100

DESCRIPTION = """\
Checks a GPU host before `docker compose up`: Docker Compose v2, the NVIDIA runtime, the GPUs
named by PREFILL_GPUS/DECODE_GPUS, the MoE backend for their compute capability, GPU memory for
the weights, the driver for the image's CUDA, NIXL in the image, PD_SUBNET, free disk, the model
and its token, and free host ports. Settings are the ones Compose resolves from compose.yaml's
x-kit-settings (environment > env file > defaults). Each result is one line, ok/WARN/FAIL, and
every FAIL names the fix; the exit status is the number of FAILs (at most 100).
"""
EPILOG = """\
COMPOSE_PROFILES=cpu (or --profile cpu) skips the GPU checks. Test hooks: PREFLIGHT_DOCKER,
PREFLIGHT_NVIDIA_SMI and PREFLIGHT_IP name the commands to call, PREFLIGHT_COMPOSE_FILE the
compose file. See docs/preflight.md.
"""


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
    parser.add_argument(
        "--env-file",
        type=Path,
        metavar="FILE",
        help="env file Compose reads instead of the repo's .env",
    )
    parser.add_argument(
        "--profile",
        action="append",
        default=[],
        metavar="NAME",
        help="Compose profile to check (repeatable; default: COMPOSE_PROFILES)",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="print a JSON list of {check, status, message} instead of lines",
    )
    return parser.parse_args(argv)


def run_checks(ctx: Context) -> list[Result]:
    """All checks in dependency order; those needing the settings stop if they did not load."""
    results = check_docker.compose(ctx)
    if ctx.compose_ok:
        results += check_docker.load_settings(ctx)
    results += check_profile.choose_mode(ctx)
    if ctx.docker_found:
        results += check_docker.daemon(ctx)
    if ctx.gpu_mode:
        results += check_gpu.inventory(ctx)
    if ctx.settings is None:
        msg = (
            "the other checks read compose.yaml's settings, so they did not run: fix the FAIL "
            "lines above, then run scripts/preflight.sh again."
        )
        return results + [report.warn("settings", msg)]
    if ctx.gpu_mode:
        results += check_moe.moe_backend(ctx)
        results += check_memory.gpu_memory(ctx)
        results += check_driver.driver_cuda(ctx)
        results += check_docker.nixl(ctx)
    results += check_subnet.subnet(ctx)
    results += check_disk.disk(ctx)
    results += check_model.model(ctx)
    results += check_model.secret_files(ctx)
    results += check_ports.ports(ctx)
    return results


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
    )
    results = run_checks(ctx)
    if args.json:
        sys.stdout.write(report.render_json(results))
    else:
        env = f" --env-file {args.env_file}" if args.env_file is not None else ""
        sys.stdout.write(report.render_text(results, f"docker compose{env} up -d"))
    return report.exit_status(results)
