"""The real ``pd-proxy`` process drains in-flight streams on SIGTERM and exits 0."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import sys

import aiohttp

from pd_proxy.testing.fake_model import DECODE, PREFILL
from pd_proxy.testing.fake_vllm import FakeVLLM
from tests.proxy.proxy_harness import sse_events

TOKENS = 20


async def test_sigterm_drains_in_flight_streams_then_exits_0():
    prefill, decode = FakeVLLM(role=PREFILL), FakeVLLM(role=DECODE)
    decode.knobs.token_delay = 0.05  # each stream lasts about a second
    proc = None
    lines: list[str] = []
    try:
        await prefill.start()
        await decode.start()
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "pd_proxy", "--host", "127.0.0.1", "--port", "0",
            "--prefill", prefill.url, "--decode", decode.url, "--drain-timeout", "30",
            stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        assert proc.stderr is not None
        url = None
        while url is None:
            line = (await proc.stderr.readline()).decode()
            assert line, f"proxy exited early: {lines}"
            lines.append(line)
            match = re.search(r"listening on (http://\S+)", line)
            url = match.group(1) if match else None

        async def pump() -> None:
            assert proc is not None and proc.stderr is not None
            async for raw in proc.stderr:
                lines.append(raw.decode())

        pumping = asyncio.create_task(pump())
        async with aiohttp.ClientSession() as session:

            async def stream(i: int) -> bytes:
                body = {"prompt": str(i), "max_tokens": TOKENS, "stream": True}
                async with session.post(f"{url}/v1/completions", json=body) as r:
                    assert r.status == 200
                    return await r.read()

            tasks = [asyncio.create_task(stream(i)) for i in range(4)]
            await decode.wait_for(lambda: len(decode.seen) == 4)
            proc.send_signal(signal.SIGTERM)
            bodies = await asyncio.gather(*tasks)
        for raw in bodies:
            events = sse_events(raw)
            assert events[-1] == "[DONE]"
            texts = [json.loads(e)["choices"][0]["text"] for e in events[:-1]]
            assert texts == [f" t{k}" for k in range(TOKENS)]
        assert await proc.wait() == 0
        await pumping
        log = "".join(lines)
        assert "shutting down" in log and "stopped" in log
        assert log.count("status=200") == 4
        assert decode.cancelled == []
    finally:
        if proc is not None and proc.returncode is None:
            proc.kill()
            await proc.wait()
        await prefill.stop()
        await decode.stop()
