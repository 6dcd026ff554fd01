"""``--workers N``: N proxy processes on one port (SO_REUSEPORT), under a supervising parent.

The parent binds the port first (with SO_REUSEPORT, never listening on it): a busy port fails
here, once, and port 0 becomes a real port that every worker then shares. It starts N workers,
each a fresh interpreter (``python -m pd_proxy.workers.child``) running the whole proxy (its own
backend
pools, health checks and client session) with SO_REUSEPORT, so the kernel spreads new
connections across them. Then it:

- logs ``listening on ...`` once every worker listens, and exits 2 if one fails to start (its own
  ``pd-proxy: error:`` line says why);
- forwards SIGTERM/SIGINT to every worker, which drains like a single proxy, and exits 0 once all
  have exited 0 (a worker still running ``STOP_GRACE_S`` after the drain timeout is killed);
- when a worker exits on its own (a crash, a kill), says which and how, stops the others (drain)
  and exits 1, for the orchestrator to restart the whole proxy; it does not respawn workers;
- leaves no orphan: workers get SIGTERM from the kernel if the parent dies (Linux
  ``PR_SET_PDEATHSIG``), and the parent waits for every worker before it exits.

Metrics: the parent gives the workers a private ``PROMETHEUS_MULTIPROC_DIR`` (created here, removed
on exit), so ``/metrics`` on any worker reports the sum over all of them (pd_proxy.metrics).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile

from pd_proxy.config import ProxyConfig
from pd_proxy.logs import flush_periodically, setup_logging
from pd_proxy.port_reservation import ListenError, reserve_port
from pd_proxy.workers.child import STATE_ENV

log = logging.getLogger("pd_proxy.workers.supervisor")

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
# How long past --drain-timeout a stopping worker may run before it is killed.
STOP_GRACE_S = 10.0


def _describe(returncode: int) -> str:
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"was killed by {name}"
    return f"exited with code {returncode}"


class _Worker:
    def __init__(self, index: int, proc: asyncio.subprocess.Process, ready_fd: int) -> None:
        self.index = index
        self.proc = proc
        self.ready_fd = ready_fd

    @property
    def name(self) -> str:
        return f"worker {self.index} (pid {self.proc.pid})"

    def ready(self) -> asyncio.Future[bool]:
        """True once the worker listens; False if it went away first."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[bool] = loop.create_future()

        def readable() -> None:
            try:
                data = os.read(self.ready_fd, 64)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            loop.remove_reader(self.ready_fd)
            if not future.done():
                future.set_result(data.startswith(b"ready"))

        os.set_blocking(self.ready_fd, False)
        loop.add_reader(self.ready_fd, readable)
        return future

    def close(self) -> None:
        with contextlib.suppress(OSError):
            asyncio.get_running_loop().remove_reader(self.ready_fd)
            os.close(self.ready_fd)

    def signal(self, sig: int) -> None:
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(sig)


class Supervisor:
    """Starts and watches the workers; ``run()`` returns the parent's exit code."""

    def __init__(self, config: ProxyConfig, metrics_dir: str) -> None:
        self.config = config
        self.metrics_dir = metrics_dir
        self.workers: list[_Worker] = []
        self.stop_signal: int | None = None

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()

        def on_signal(sig: int) -> None:
            if self.stop_signal is None:
                self.stop_signal = sig
            stop.set()

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal, sig)
        try:
            return await self._watch(stop)
        finally:
            for worker in self.workers:
                worker.close()

    async def _watch(self, stop: asyncio.Event) -> int:
        n = self.config.workers
        for index in range(1, n + 1):
            try:
                self.workers.append(await self._spawn(index))
            except OSError as exc:
                log.error("cannot start worker %d: %s", index, exc)
                await self._stop_all(signal.SIGTERM)
                return 1
        exits: dict[asyncio.Future, _Worker] = {
            asyncio.ensure_future(w.proc.wait()): w for w in self.workers
        }
        readies: dict[asyncio.Future, _Worker] = {
            asyncio.ensure_future(w.ready()): w for w in self.workers
        }
        stopping = asyncio.ensure_future(stop.wait())
        waiting: set[asyncio.Future] = {*exits, *readies, stopping}
        ready = 0
        try:
            while True:
                done, waiting = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                for future in done:
                    if future in readies and future.result():
                        ready += 1
                        if ready == n:
                            log.info(
                                "listening on http://%s:%d with %d workers",
                                self.config.host,
                                self.config.port,
                                n,
                            )
                dead = [exits[f] for f in done if f in exits]
                if dead:
                    worker = dead[0]
                    code = worker.proc.returncode
                    assert code is not None
                    if ready < n:
                        message = f"{worker.name} {_describe(code)} while starting"
                        rc = 2 if code == 2 else 1
                    else:
                        message = f"{worker.name} {_describe(code)} unexpectedly"
                        rc = 1
                    log.error("%s; stopping the other workers", message)
                    await self._stop_all(signal.SIGTERM)
                    print(f"pd-proxy: error: {message}", file=sys.stderr)
                    return rc
                if stopping in done:
                    assert self.stop_signal is not None
                    log.info(
                        "shutting down: %s sent to %d workers (drain up to %gs)",
                        signal.Signals(self.stop_signal).name,
                        n,
                        self.config.drain_timeout,
                    )
                    return await self._stop_all(self.stop_signal)
        finally:
            for future in waiting:
                future.cancel()

    async def _spawn(self, index: int) -> _Worker:
        read_fd, write_fd = os.pipe()
        state = {
            "config": dataclasses.asdict(self.config),
            "index": index,
            "parent": os.getpid(),
            "ready_fd": write_fd,
        }
        env = {
            **os.environ,
            MULTIPROC_ENV: self.metrics_dir,
            STATE_ENV: json.dumps(state),
            # The parent's sys.path, so the worker runs the same pd_proxy however the parent found
            # it (installed, PYTHONPATH, a test's sys.path entry).
            "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
        }
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "pd_proxy.workers.child", env=env, pass_fds=(write_fd,)
            )
        except OSError:
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)
        log.info("worker %d: pid %d", index, proc.pid)
        return _Worker(index, proc, read_fd)

    async def _stop_all(self, sig: int) -> int:
        """Send ``sig`` to every running worker and wait for them; 0 if all exited 0."""
        for worker in self.workers:
            worker.signal(sig)
        loop = asyncio.get_running_loop()
        limit = self.config.drain_timeout + STOP_GRACE_S
        deadline = loop.time() + limit  # the workers drain at the same time
        rc = 0
        for worker in self.workers:
            try:
                code = await asyncio.wait_for(
                    asyncio.shield(worker.proc.wait()), max(0.1, deadline - loop.time())
                )
            except asyncio.TimeoutError:
                log.error("%s still running %gs after the signal: killing it", worker.name, limit)
                worker.signal(signal.SIGKILL)
                code = await worker.proc.wait()
            _mark_dead(worker.proc.pid, self.metrics_dir)
            # A worker still starting has no handler yet: the signal itself ends it, cleanly.
            if code not in (0, -sig) and self.stop_signal is not None and rc == 0:
                log.error("%s %s while draining", worker.name, _describe(code))
                rc = 1
        return rc


def _mark_dead(pid: int, path: str) -> None:
    """Drop a dead worker's live gauges from the merged metrics (its counters stay)."""
    try:
        from prometheus_client.multiprocess import mark_process_dead
    except ImportError:  # pragma: no cover
        return
    with contextlib.suppress(OSError):
        mark_process_dead(pid, path)


def supervise(config: ProxyConfig) -> int:
    """Run ``config.workers`` workers on ``config.port`` until a signal; the exit code."""
    handler = setup_logging(config.logging_level, tag="[supervisor] ")
    sockets: list[socket.socket] = []
    metrics_dir = None
    try:
        try:
            main, port = reserve_port(config.host, config.port)
            sockets += main
            metrics_port = config.metrics_port
            if metrics_port is not None:
                extra, metrics_port = reserve_port(config.host, metrics_port, " (metrics port)")
                sockets += extra
        except ListenError as exc:
            handler.flush()
            print(f"pd-proxy: error: {exc}", file=sys.stderr)
            return 2
        config = dataclasses.replace(config, port=port, metrics_port=metrics_port)
        metrics_dir = tempfile.mkdtemp(prefix="pd-proxy-metrics-")
        return asyncio.run(_supervise(config, metrics_dir, handler))
    finally:
        handler.flush()
        for sock in sockets:
            sock.close()
        if metrics_dir is not None:
            shutil.rmtree(metrics_dir, ignore_errors=True)


async def _supervise(config: ProxyConfig, metrics_dir: str, handler: logging.Handler) -> int:
    flusher = asyncio.create_task(flush_periodically(handler))
    try:
        rc = await Supervisor(config, metrics_dir).run()
        log.info("stopped" if rc == 0 else "stopped with errors")
        return rc
    finally:
        flusher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await flusher
