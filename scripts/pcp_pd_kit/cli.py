"""`pcp-pd-kit`: every user-facing job of the kit behind one command line.

`up` and `demo` run the local CPU stack, `bench KIND` runs one of the kit's benchmarks (serve:
single vs P/D with `vllm bench serve`; proxy, connector, prefill, tokenize, xpyd, ...), `eval`
scores GSM8K through any P/D proxy, `preflight` checks a GPU host before `docker compose up`.
eval and preflight keep their own flags (they are also called by path, as scripts/eval_gsm8k.sh
and scripts/preflight.sh), so their arguments pass through untouched.
Heavy imports happen inside the chosen command: `pcp-pd-kit preflight` needs no vLLM.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Sequence

PASS_THROUGH = {
    "eval": "GSM8K accuracy through the P/D proxy, pass/fail (same flags as scripts/eval_gsm8k.sh)",
    "preflight": "check a GPU host before `docker compose up` (same as scripts/preflight.sh)",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pcp-pd-kit", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub.add_parser("up", help="local CPU stack: prefill, decode, proxy, Prometheus until Ctrl-C")
    demo = sub.add_parser("demo", help="local CPU stack: start, GSM8K slice, report, stop")
    demo.add_argument("--limit", type=int, default=None, help="GSM8K questions (DEMO_LIMIT)")
    from pcp_pd_kit.bench.kinds import KINDS, add_kind_parsers

    bench = sub.add_parser(
        "bench",
        help=f"benchmarks, one results layout: {', '.join(KINDS)} (docs/bench.md)",
        description="The kit's benchmarks; each writes result.json, table.md, manifest.json and "
        "summary.{json,md} under results/<kind>-<UTC time>/ (see docs/bench.md)",
    )
    add_kind_parsers(bench)
    for name, text in PASS_THROUGH.items():
        sub.add_parser(name, help=text, add_help=False)
    return parser


def _term_as_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def run_stack_command(args: argparse.Namespace, argv: Sequence[str] = ()) -> int:
    """up, demo, bench: settings from the layered env, one `finally` that stops what started."""
    from pcp_pd_kit.bench.client import BenchError
    from pcp_pd_kit.bench.kinds import BenchUsageError, run_kind
    from pcp_pd_kit.localstack.host import PortInUseError
    from pcp_pd_kit.localstack.model_source import ModelNotAvailableError
    from pcp_pd_kit.localstack.process import StackProcessError
    from pcp_pd_kit.localstack.run import cmd_demo, cmd_up
    from pcp_pd_kit.settings import EnvFileError, SettingsError, kit_env, settings_from_env

    user_errors = (
        EnvFileError,
        SettingsError,
        ModelNotAvailableError,
        PortInUseError,
        StackProcessError,
        BenchError,
        BenchUsageError,
    )
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s pcp-pd-kit %(message)s", datefmt="%H:%M:%S"
    )
    # Both as KeyboardInterrupt so one `finally` stops the stack; SIGINT explicitly because a
    # shell that backgrounds the launcher leaves SIGINT ignored.
    previous = {
        sig: signal.signal(sig, _term_as_interrupt) for sig in (signal.SIGTERM, signal.SIGINT)
    }
    try:
        if args.command == "bench":
            return run_kind(args, [sys.executable, "-m", "pcp_pd_kit", *argv])
        settings = settings_from_env(kit_env(os.environ))
        if args.command == "up":
            return cmd_up(settings)
        return cmd_demo(settings, args.limit or settings.demo_limit)
    except user_errors as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted; everything stopped", file=sys.stderr)
        return 130
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in PASS_THROUGH:
        command, rest = argv[0], argv[1:]
        if command == "eval":
            from pcp_pd_kit.gsm8k.entry import main as eval_main

            return eval_main(rest)
        from pcp_pd_kit.preflight.cli import main as preflight_main

        return preflight_main(rest)
    return run_stack_command(build_parser().parse_args(argv), argv)
