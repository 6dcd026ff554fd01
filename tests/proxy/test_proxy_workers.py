"""``--workers N``: several proxy processes on one port under a supervising parent."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import sys
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import pytest

from pd_proxy.testing.fake_model import DECODE, PREFILL
from pd_proxy.testing.fake_vllm import FakeVLLM
from tests.proxy.proxy_harness import sse_events

pytestmark = pytest.mark.skipif(
    not hasattr(socket, "SO_REUSEPORT"), reason="needs SO_REUSEPORT (Linux, BSD)"
)

REQUESTS = 40
WORKER_LINE = re.compile(r"\[worker (\d+) pid (\d+)\] rid=\S+ /v1/completions status=200")


class Proxy:
    """A ``pd-proxy`` process and its stderr, read as it comes."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.lines: list[str] = []
        self._changed = asyncio.Event()
        self._pump = asyncio.create_task(self._read())

    async def _read(self) -> None:
        assert self.proc.stderr is not None
        async for raw in self.proc.stderr:
            self.lines.append(raw.decode())
            self._changed.set()
        self._changed.set()

    @property
    def log(self) -> str:
        return "".join(self.lines)

    async def wait_for(self, pattern: str, timeout: float = 30.0) -> re.Match:
        async def poll() -> re.Match:
            while True:
                match = re.search(pattern, self.log)
                if match:
                    return match
                if self._pump.done():
                    raise AssertionError(f"proxy exited without {pattern!r}:\n{self.log}")
                self._changed.clear()
                await self._changed.wait()

        return await asyncio.wait_for(poll(), timeout)

    def worker_pids(self) -> dict[int, int]:
        return {int(i): int(p) for i, p in re.findall(r"worker (\d+): pid (\d+)", self.log)}

    async def exit_code(self, timeout: float = 30.0) -> int:
        code = await asyncio.wait_for(self.proc.wait(), timeout)
        await self._pump
        return code


@asynccontextmanager
async def running_proxy(tmp_path: Path, *args: str, token_delay: float = 0.0):
    """Fakes in this process, ``pd-proxy --workers 2`` in another; TMPDIR is ``tmp_path``."""
    prefill, decode = FakeVLLM(role=PREFILL), FakeVLLM(role=DECODE)
    decode.knobs.token_delay = token_delay
    proxy = None
    try:
        await prefill.start()
        await decode.start()
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "pd_proxy", "--host", "127.0.0.1", "--port", "0",
            "--prefill", prefill.url, "--decode", decode.url, "--workers", "2", *args,
            stderr=asyncio.subprocess.PIPE, env={**os.environ, "TMPDIR": str(tmp_path)},
        )  # fmt: skip
        proxy = Proxy(proc)
        yield proxy, prefill, decode
    finally:
        if proxy is not None and proxy.proc.returncode is None:
            proxy.proc.kill()
            await proxy.proc.wait()
        await prefill.stop()
        await decode.stop()


def gone(pid: int) -> bool:
    """No such process, or a zombie nobody reaps (a container's init may not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


async def wait_gone(pids, timeout: float = 15.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not all(gone(p) for p in pids):
        assert loop.time() < deadline, f"still running: {[p for p in pids if not gone(p)]}"
        await asyncio.sleep(0.05)


async def get_metrics(url: str) -> str:
    # A new connection each time, so the kernel may pick either worker.
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
        async with s.get(url + "/metrics") as r:
            assert r.status == 200
            return await r.text()


async def test_two_workers_share_the_port_sum_their_metrics_and_drain_on_sigterm(tmp_path):
    async with running_proxy(tmp_path, "--metrics-port", "0", token_delay=0.05) as (
        proxy,
        prefill,
        decode,
    ):
        url = (await proxy.wait_for(r"listening on (http://\S+) with 2 workers")).group(1)
        metrics_url = (await proxy.wait_for(r"metrics on (http://\S+)/metrics")).group(1)
        pids = proxy.worker_pids()
        assert sorted(pids) == [1, 2] and len(set(pids.values())) == 2
        decode.knobs.token_delay = 0.0
        connector = aiohttp.TCPConnector(force_close=True)  # a new connection per request
        async with aiohttp.ClientSession(connector=connector) as session:
            for i in range(REQUESTS):
                body = {"prompt": str(i), "max_tokens": 2}
                async with session.post(f"{url}/v1/completions", json=body) as r:
                    assert r.status == 200, await r.text()
        assert decode.completed == REQUESTS

        # Both workers served (each logs its own lines, tagged with its number and pid).
        served = await asyncio.wait_for(_served_per_worker(proxy, REQUESTS), 10)
        assert set(served) == {(1, pids[1]), (2, pids[2])}, served

        # Any worker's /metrics is the sum over both; no _created series by default.
        for _ in range(6):
            text = await get_metrics(metrics_url)
            line = 'pd_proxy_requests_total{endpoint="/v1/completions",path="pd",status="200"}'
            assert f"{line} {float(REQUESTS)}" in text
            assert "_created" not in text
            assert "pd_proxy_in_flight_requests 0.0" in text
        metrics_dirs = list(tmp_path.glob("pd-proxy-metrics-*"))
        assert len(metrics_dirs) == 1

        # SIGTERM: in-flight streams finish on every worker, then everything exits 0.
        decode.knobs.token_delay = 0.05
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:

            async def stream(i: int) -> bytes:
                body = {"prompt": str(i), "max_tokens": 20, "stream": True}
                async with s.post(f"{url}/v1/completions", json=body) as r:
                    assert r.status == 200
                    return await r.read()

            before = len(decode.seen)
            tasks = [asyncio.create_task(stream(i)) for i in range(6)]
            await decode.wait_for(lambda: len(decode.seen) == before + 6)
            proxy.proc.send_signal(signal.SIGTERM)
            for raw in await asyncio.gather(*tasks):
                events = sse_events(raw)
                assert events[-1] == "[DONE]" and len(events) == 21
        assert await proxy.exit_code() == 0
        assert "[supervisor] stopped" in proxy.log
        assert proxy.log.count("] stopped") == 3  # both workers and the supervisor
        await wait_gone(pids.values())
        assert not metrics_dirs[0].exists()  # the private metrics directory is removed


async def _served_per_worker(proxy: Proxy, total: int) -> dict[tuple[int, int], int]:
    while True:  # the workers flush their request lines every half second
        found: dict[tuple[int, int], int] = {}
        for worker, pid in WORKER_LINE.findall(proxy.log):
            key = (int(worker), int(pid))
            found[key] = found.get(key, 0) + 1
        if sum(found.values()) >= total:
            return found
        await asyncio.sleep(0.1)


async def test_a_killed_worker_stops_the_proxy_with_an_error(tmp_path):
    async with running_proxy(tmp_path) as (proxy, _prefill, _decode):
        await proxy.wait_for(r"listening on http://\S+ with 2 workers")
        pids = proxy.worker_pids()
        os.kill(pids[2], signal.SIGKILL)
        assert await proxy.exit_code() == 1
        assert f"pd-proxy: error: worker 2 (pid {pids[2]}) was killed by SIGKILL" in proxy.log
        assert "stopping the other workers" in proxy.log
        await wait_gone(pids.values())
        assert list(tmp_path.glob("pd-proxy-metrics-*")) == []


async def test_workers_exit_when_the_supervisor_is_killed(tmp_path):
    async with running_proxy(tmp_path) as (proxy, _prefill, _decode):
        await proxy.wait_for(r"listening on http://\S+ with 2 workers")
        pids = proxy.worker_pids()
        proxy.proc.kill()
        await proxy.exit_code()
        await wait_gone(pids.values())  # PR_SET_PDEATHSIG: each drains and exits


async def test_merged_worker_metrics_have_no_created_series_even_when_asked(tmp_path):
    """prometheus_client's multiprocess files keep no creation times (README: Metrics)."""
    async with running_proxy(tmp_path, "--metrics-created") as (proxy, _prefill, _decode):
        url = (await proxy.wait_for(r"listening on (http://\S+) with 2 workers")).group(1)
        async with aiohttp.ClientSession() as s:
            async with s.post(f"{url}/v1/completions", json={"prompt": "x"}) as r:
                assert r.status == 200
        text = await get_metrics(url)
        assert (
            'pd_proxy_requests_total{endpoint="/v1/completions",path="pd",status="200"} 1.0' in text
        )
        assert "_created" not in text
        proxy.proc.send_signal(signal.SIGINT)
        assert await proxy.exit_code() == 0


async def test_a_busy_port_exits_2_before_any_worker_starts():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "pd_proxy", "--host", "127.0.0.1", "--port", str(port),
            "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2",
            "--workers", "2", stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        _, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 2
    text = err.decode()
    assert f"pd-proxy: error: cannot listen on 127.0.0.1:{port}" in text
    assert "worker 1" not in text


def test_line_handler_writes_whole_lines_at_most_pipe_buf_bytes(monkeypatch):
    import logging

    from pd_proxy import logs

    writes: list[bytes] = []
    monkeypatch.setattr(logs.os, "write", lambda fd, data: writes.append(bytes(data)) or len(data))
    handler = logs.LineHandler(2)
    handler.setFormatter(logs.FastFormatter("[worker 3 pid 7] "))
    logger = logging.getLogger("pd_proxy.test_line_handler")
    logger.propagate = False
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        for i in range(500):
            logger.info("line %d %s", i, "x" * (i % 97))
        logger.info("long %s", "y" * (2 * logs.PIPE_BUF))
        handler.flush()
    finally:
        logger.removeHandler(handler)
    lines = b"".join(writes).decode().splitlines()
    numbers = [re.search(r"\] line (\d+) ", line) for line in lines[:500]]
    assert [m.group(1) for m in numbers if m] == [str(i) for i in range(500)]
    assert all("[worker 3 pid 7] " in line for line in lines)
    assert all(w.endswith(b"\n") for w in writes)
    assert all(len(w) <= logs.PIPE_BUF for w in writes[:-1])  # the last is the one long line
    assert len(writes[-1]) > logs.PIPE_BUF and writes[-1].count(b"\n") == 1


def test_fast_formatter_with_a_tag_matches_the_stdlib_format():
    import logging

    from pd_proxy.logs import FORMAT, FastFormatter

    record = logging.LogRecord("pd_proxy", logging.INFO, __file__, 1, "a %s", ("b",), None)
    std = logging.Formatter(FORMAT.replace("%(message)s", "[supervisor] %(message)s"))
    assert FastFormatter("[supervisor] ").format(record) == std.format(record)


def test_worker_state_round_trips_the_config():
    import dataclasses

    from pd_proxy.config import ProxyConfig

    config = ProxyConfig(
        prefill=("http://127.0.0.1:1",), decode=("http://127.0.0.1:2",), workers=3, port=0
    )
    values = json.loads(json.dumps(dataclasses.asdict(config)))
    assert ProxyConfig(**values) == config
