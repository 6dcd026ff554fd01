"""``python -m pd_proxy.testing.fake_fleet --replicas R --port P``: the fake fleet in its own
process, its control API on port P, serving until SIGTERM or SIGINT; it prints ``fleet {json}``
(what ``GET /fleet`` answers: the control URL and the replicas' URLs) once it serves."""

from __future__ import annotations

import argparse
import asyncio
import signal

from pd_proxy.testing.fake_fleet import Fleet, serve


async def main_async(args: argparse.Namespace) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await serve(Fleet(args.replicas, args.block_size, args.host), stop, args.port)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--replicas", type=int, default=8, help="prefills, and as many decodes")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="the control API's (0: any)")
    args = parser.parse_args(argv)
    try:
        import uvloop
    except ImportError:
        asyncio.run(main_async(args))
    else:
        uvloop.run(main_async(args))


if __name__ == "__main__":
    main()
