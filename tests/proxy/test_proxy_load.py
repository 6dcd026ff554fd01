"""Bounded load: many concurrent mixed requests, none lost or corrupted."""

from __future__ import annotations

import asyncio
import json

from tests.proxy.proxy_harness import pd_stack, sse_events

TOTAL = 2000
CONCURRENCY = 64


async def test_2000_requests_at_64_concurrency_lose_nothing():
    async with pd_stack(prefills=2, decodes=2) as s:
        for fake in s.prefills + s.decodes:
            fake.record = False  # keep memory flat; correctness is checked on the client side
        queue: asyncio.Queue[int] = asyncio.Queue()
        for i in range(TOTAL):
            queue.put_nowait(i)
        ok: list[int] = []
        failures: list[str] = []

        async def worker() -> None:
            while not queue.empty():
                i = queue.get_nowait()
                chat = i % 3 == 0
                stream = i % 2 == 0
                n = 1 + i % 8
                body = (
                    {"messages": [{"role": "user", "content": str(i)}], "max_tokens": n}
                    if chat
                    else {"prompt": str(i), "max_tokens": n}
                )
                body["stream"] = stream
                path = "/v1/chat/completions" if chat else "/v1/completions"
                rid = f"load-{i}"
                status, headers, raw = await s.post(path, body, {"X-Request-Id": rid})
                if status != 200 or headers.get("X-Request-Id") != rid:
                    failures.append(f"{rid}: {status} {raw[:200]!r}")
                    continue
                if stream:
                    events = sse_events(raw)
                    tokens = [json.loads(e)["choices"][0] for e in events[:-1]]
                    if chat:  # vLLM's first chat chunk carries the role only
                        assert tokens.pop(0)["delta"] == {"role": "assistant", "content": ""}
                    texts = [t["delta"]["content"] if chat else t["text"] for t in tokens]
                    good = events[-1] == "[DONE]" and texts == [f" t{k}" for k in range(n)]
                else:
                    choice = json.loads(raw)["choices"][0]
                    text = choice["message"]["content"] if chat else choice["text"]
                    good = text == "".join(f" t{k}" for k in range(n))
                (ok.append(i) if good else failures.append(f"{rid}: bad body {raw[:200]!r}"))

        await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
        assert failures == []
        assert sorted(ok) == list(range(TOTAL))
        assert sum(f.completed for f in s.prefills) == TOTAL
        assert sum(f.completed for f in s.decodes) == TOTAL
        assert min(f.completed for f in s.decodes) > 0
        assert s.sample("pd_proxy_in_flight_requests") == 0
        served = sum(
            s.sample("pd_proxy_requests_total", {"endpoint": p, "status": "200", "path": "pd"}) or 0
            for p in ("/v1/completions", "/v1/chat/completions")
        )
        assert served == TOTAL
