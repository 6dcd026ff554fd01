"""``python -m pd_proxy.testing.fake_vllm``: one fake vLLM server in its own process.

The package's entry point, kept apart from the server class (the package's ``__init__``) so that
the bench and the tests that need a separate process (a killed backend, a real eval harness)
start the same fake from a command line, and the server module need not import its own CLI. The
fake records nothing here, since it may serve a benchmark; it prints ``listening on URL`` once it
serves.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from pathlib import Path

from pd_proxy.testing import fake_vllm
from pd_proxy.testing.fake_model import DECODE, GSM8K_MODES, PLAIN, PREFILL, load_answers
from pd_proxy.testing.fake_vllm import FakeVLLM, Knobs


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(fake_vllm.__doc__ or "").splitlines()[0])
    parser.add_argument("--role", choices=(PREFILL, DECODE, PLAIN), default=PLAIN)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--model", default="fake-model")
    parser.add_argument("--delay", type=float, default=0.0)
    parser.add_argument("--token-delay", type=float, default=0.0)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument(
        "--api-key-file", help="require the first line of this file as a bearer key on /v1/*"
    )
    parser.add_argument("--engine-id", default="", help="prefill: the engine its handles name")
    parser.add_argument("--prefill-engine-id", help="decode: accept only this engine's handles")
    parser.add_argument("--gsm8k-data", help="answer the GSM8K questions of DIR/test.jsonl")
    parser.add_argument("--gsm8k-mode", choices=GSM8K_MODES, default="mixed")
    return parser.parse_args(argv)


def from_args(args: argparse.Namespace) -> FakeVLLM:
    """The fake the command line describes; it records nothing (it may serve a benchmark)."""
    api_key = None
    if args.api_key_file:
        with open(args.api_key_file, encoding="utf-8") as f:
            api_key = f.readline().strip()
    knobs = Knobs(
        delay=args.delay,
        token_delay=args.token_delay,
        tokens=args.tokens,
        gsm8k_mode=args.gsm8k_mode,
    )
    return FakeVLLM(
        role=args.role,
        model=args.model,
        record=False,
        knobs=knobs,
        engine_id=args.engine_id,
        prefill_engine_id=args.prefill_engine_id,
        answers=load_answers(Path(args.gsm8k_data)) if args.gsm8k_data else None,
        api_key=api_key,
    )


async def serve(fake: FakeVLLM, host: str, port: int) -> None:
    """Serve until SIGTERM or SIGINT; the ``listening on URL`` line tells a parent the port."""
    url = await fake.start(host, port)
    print(f"listening on {url}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await fake.stop()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    run = serve(from_args(args), args.host, args.port)
    try:
        import uvloop
    except ImportError:
        asyncio.run(run)
    else:
        uvloop.run(run)
    sys.exit(0)


if __name__ == "__main__":
    main()
