"""``pd-proxy`` entry point: settings, one check of what they name, then serve or supervise.

``main`` parses flags and the environment into a frozen ``ProxyConfig`` (pd_proxy.config, no
I/O), checks the files and the cluster it names once (pd_proxy.api.startup_checks, every problem
listed),
then serves in this process (pd_proxy.serve) or, with ``--workers N`` (N > 1), supervises N
``python -m pd_proxy.workers.child`` processes (pd_proxy.workers.supervisor). Bad settings exit 2
with one
``pd-proxy: error:`` line per problem.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from pd_proxy.api.startup_checks import validate
from pd_proxy.config import ConfigError, load_config
from pd_proxy.logs import setup_logging
from pd_proxy.port_reservation import ListenError
from pd_proxy.serve import run, serve
from pd_proxy.workers.supervisor import supervise

__all__ = ["ListenError", "main", "run", "serve"]


def main(argv: Sequence[str] | None = None) -> int:
    try:
        config = load_config(argv)
        validate(config)
    except ConfigError as exc:
        for problem in exc.problems:
            print(f"pd-proxy: error: {problem}", file=sys.stderr)
        return 2
    if config.workers > 1:
        return supervise(config)
    return run(config, setup_logging(config.logging_level))


if __name__ == "__main__":
    raise SystemExit(main())
