"""A fake vLLM server that answers GSM8K questions, for exercising eval_gsm8k.sh through pd-proxy.

It speaks the NIXL P/D ``kv_transfer_params`` protocol the real servers do: a ``prefill`` fake only
accepts ``max_tokens=1`` requests asking for a remote decode and hands back KV handles; a ``decode``
fake only accepts requests carrying handles issued by that prefill (engine id given on the command
line). The decode fake finds the last ``Question: ...`` in the prompt, looks it up in GSM8K and
answers ``#### <answer>`` (mode ``correct``), a wrong number (``wrong``) or right on 13 of every
20 rows (``mixed``: the reference 0.65); ``POST
/fake/mode`` switches the mode at run time. It also serves /health, /version, /v1/models and a
vLLM-looking /metrics so the manifest's topology probe has something real to read.

Run: python gsm8k_fake.py --role decode --port 17001 --data-dir DIR --prefill-engine-id ID
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import re
import signal
from pathlib import Path
from typing import Any

from aiohttp import web

_QUESTION = re.compile(r"Question: (.*?)\nAnswer:", re.S)


def load_answers(data_dir: Path) -> dict[str, tuple[str, int]]:
    """Test question text -> (final numeric answer after '#### ', row index)."""
    answers = {}
    lines = (data_dir / "test.jsonl").read_text(encoding="utf-8").splitlines()
    for index, line in enumerate(lines):
        row = json.loads(line)
        answers[row["question"].strip()] = (row["answer"].rsplit("#### ", 1)[-1].strip(), index)
    return answers


def is_right(mode: str, index: int) -> bool:
    """correct: always; wrong: never; mixed: 13 of every 20 rows (0.65, the reference score)."""
    return mode == "correct" or (mode == "mixed" and index % 20 < 13)


def wrong(answer: str) -> str:
    try:
        return str(int(answer.replace(",", "")) + 7)
    except ValueError:
        return "-1"


class Fake:
    def __init__(self, args: argparse.Namespace) -> None:
        self.role = args.role
        self.model = args.model
        self.mode = args.mode
        self.engine_id = args.engine_id
        self.prefill_engine_id = args.prefill_engine_id
        self.answers = load_answers(Path(args.data_dir)) if self.role == "decode" else {}
        self.blocks = itertools.count(1)
        self.counts = {"ok": 0, "rejected": 0, "unknown_question": 0}

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", lambda _: web.Response(text="ok"))
        app.router.add_get("/version", lambda _: web.json_response({"version": "0.32.0-fake"}))
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/fake/mode", self.set_mode)
        return app

    async def models(self, _: web.Request) -> web.Response:
        model = {"id": self.model, "object": "model", "root": self.model, "max_model_len": 4096}
        return web.json_response({"object": "list", "data": [model]})

    async def set_mode(self, request: web.Request) -> web.Response:
        self.mode = (await request.json())["mode"]
        return web.json_response({"mode": self.mode})

    async def metrics(self, _: web.Request) -> web.Response:
        source = "local_compute" if self.role == "prefill" else "external_kv_transfer"
        lines = [
            "# TYPE vllm:cache_config_info gauge",
            f'vllm:cache_config_info{{block_size="128",engine="0",role="{self.role}"}} 1.0',
            f'vllm:prompt_tokens_by_source_total{{engine="0",source="{source}"}} '
            f"{self.counts['ok'] * 100}",
            f'vllm:nixl_xfer_time_seconds_count{{engine="0"}} {self.counts["ok"]}',
            'vllm:nixl_num_failed_transfers_total{engine="0"} 0',
            f'fake_requests_total{{result="ok"}} {self.counts["ok"]}',
            f'fake_requests_total{{result="rejected"}} {self.counts["rejected"]}',
            f'fake_requests_total{{result="unknown_question"}} {self.counts["unknown_question"]}',
        ]
        return web.Response(text="\n".join(lines) + "\n")

    def _reject(self, why: str) -> web.Response:
        self.counts["rejected"] += 1
        return web.json_response({"error": {"message": why, "code": 400}}, status=400)

    async def completions(self, request: web.Request) -> web.Response:
        body: dict[str, Any] = await request.json()
        kv = body.get("kv_transfer_params") or {}
        prompt = body.get("prompt")
        if isinstance(prompt, list):
            if len(prompt) != 1 or not isinstance(prompt[0], str):
                return self._reject("one text prompt per request expected")
            prompt = prompt[0]
        if body.get("model") != self.model:
            return self._reject(f"model {body.get('model')!r} is not served here")
        if self.role == "prefill":
            if kv.get("do_remote_decode") is not True or body.get("max_tokens") != 1:
                return self._reject("prefill wants do_remote_decode=true and max_tokens=1")
            first = next(self.blocks)
            params = {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_block_ids": [first],
                "remote_engine_id": self.engine_id,
                "remote_request_id": request.headers.get("X-Request-Id", ""),
                "remote_host": "127.0.0.1",
                "remote_port": 5600,
                "tp_size": 1,
            }
            self.counts["ok"] += 1
            return self._answer(body, " ", params)
        if kv.get("do_remote_prefill") is not True or kv.get("remote_engine_id") != (
            self.prefill_engine_id
        ):
            return self._reject("decode needs kv_transfer_params from the prefill")
        questions = _QUESTION.findall(prompt or "")
        found = self.answers.get(questions[-1].strip()) if questions else None
        if found is None:
            self.counts["unknown_question"] += 1
            return self._answer(body, " I do not know.", None)
        self.counts["ok"] += 1
        answer, index = found
        final = answer if is_right(self.mode, index) else wrong(answer)
        return self._answer(body, f" Let me think step by step.\n#### {final}\n\n", None)

    def _answer(self, body: dict[str, Any], text: str, kv: dict | None) -> web.Response:
        return web.json_response(
            {
                "id": "cmpl-fake",
                "object": "text_completion",
                "model": self.model,
                "choices": [{"index": 0, "text": text, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 100, "completion_tokens": 8, "total_tokens": 108},
                "kv_transfer_params": kv,
            }
        )


async def serve(args: argparse.Namespace) -> None:
    runner = web.AppRunner(Fake(args).app(), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", args.port).start()
    print(f"listening on http://127.0.0.1:{args.port}", flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--role", choices=("prefill", "decode"), required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", default="fake/DeepSeek-V2-Lite-Chat")
    parser.add_argument("--data-dir", default="")
    parser.add_argument("--mode", choices=("correct", "wrong", "mixed"), default="mixed")
    parser.add_argument("--engine-id", default="fake-prefill-engine")
    parser.add_argument("--prefill-engine-id", default="fake-prefill-engine")
    asyncio.run(serve(parser.parse_args()))


if __name__ == "__main__":
    main()
