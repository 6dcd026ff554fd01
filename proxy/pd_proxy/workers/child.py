"""One ``--workers`` process: ``python -m pd_proxy.workers.child``, started by
pd_proxy.workers.supervisor.

The supervisor passes the already checked settings, the worker's number, its own pid and a pipe
to report readiness through ``PD_PROXY_WORKER_STATE`` (JSON). The worker serves the whole proxy
(pd_proxy.serve) on the port the parent reserved, with SO_REUSEPORT; the config is not checked
again (the parent's pd_proxy.api.startup_checks did), and only worker 1 logs the listening
address and runs the canary.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys

from pd_proxy.config import ConfigError, ProxyConfig
from pd_proxy.logs import setup_logging
from pd_proxy.serve import run

STATE_ENV = "PD_PROXY_WORKER_STATE"
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _die_with_parent(parent: int) -> None:
    """SIGTERM (a drain) when the parent dies, however it dies; Linux only."""
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        return
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before the line above
        os.kill(os.getpid(), signal.SIGTERM)


def worker_main(state: dict) -> int:
    """One worker: the whole proxy, on the port the parent reserved, with SO_REUSEPORT."""
    _die_with_parent(state["parent"])
    index = state["index"]
    ready_fd = state["ready_fd"]
    try:
        config = ProxyConfig(**state["config"])
    except ConfigError as exc:  # pragma: no cover - the parent built the same values
        print(f"pd-proxy: error: worker {index}: {exc}", file=sys.stderr)
        return 2
    handler = setup_logging(config.logging_level, tag=f"[worker {index} pid {os.getpid()}] ")

    def ready() -> None:
        with contextlib.suppress(OSError):
            os.write(ready_fd, b"ready\n")
            os.close(ready_fd)

    return run(config, handler, reuse_port=True, announce=index == 1, on_ready=ready)


def main() -> int:
    return worker_main(json.loads(os.environ.pop(STATE_ENV)))


if __name__ == "__main__":
    raise SystemExit(main())
