"""The local tokenizer on the kit's tiny model tokenizer (pcp_pd_kit.localstack.tiny_model):
the same ids as Hugging Face's tokenizer and chat template (what vLLM's /tokenize runs), the
shapes it leaves to the server, and the start-up check that decides which shapes it serves."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from pd_proxy.protocol.endpoints import CHAT_COMPLETIONS, COMPLETIONS
from pd_proxy.routing.tokenizer import CANARY, CHAT, COMPLETION, SHAPES, LocalTokenizer

TEXTS = (
    "James has 3 apples and buys 5 more. How many",
    "  spaces, ünïcödé 🙂\nand tabs\t!",
    " ".join(f"On day {d} the farmer sold {d * 7} eggs." for d in range(1, 30)),
)
CHATS = (
    [{"role": "user", "content": "Hello there!"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": TEXTS[2]},
        {"role": "assistant", "content": "Many eggs."},
        {"role": "user", "content": "How many on day 3?"},
    ],
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from pcp_pd_kit.localstack.tiny_model import TinyModelSpec, build

    return build(tmp_path_factory.mktemp("tok") / "tiny", TinyModelSpec(corpus_lines=400))


@pytest.fixture(scope="module")
def hf(tiny: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny))


def hf_ids(hf: Any, body: dict[str, Any], endpoint: str) -> list[int]:
    """What vLLM's /tokenize answers: HF's tokenizer, and for chat its chat template then the
    tokenizer without added special tokens (vLLM's chat default)."""
    if endpoint == COMPLETIONS:
        return hf(body["prompt"], add_special_tokens=body.get("add_special_tokens", True))[
            "input_ids"
        ]
    text = hf.apply_chat_template(
        body["messages"],
        add_generation_prompt=body.get("add_generation_prompt", True),
        tokenize=False,
    )
    return hf(text, add_special_tokens=body.get("add_special_tokens", False))["input_ids"]


@pytest.mark.parametrize("special", [True, False])
@pytest.mark.parametrize("text", TEXTS)
def test_completion_ids_match_hugging_face(tiny: Path, hf: Any, text: str, special: bool) -> None:
    body = {"prompt": text, "add_special_tokens": special}
    assert LocalTokenizer(tiny).ids(body, COMPLETIONS) == hf_ids(hf, body, COMPLETIONS)


@pytest.mark.parametrize("generation", [True, False])
@pytest.mark.parametrize("messages", CHATS)
def test_chat_ids_match_hugging_face(tiny: Path, hf: Any, messages, generation: bool) -> None:
    body = {"messages": messages, "add_generation_prompt": generation}
    local = LocalTokenizer(tiny).ids(body, CHAT_COMPLETIONS)
    assert local is not None and local == hf_ids(hf, body, CHAT_COMPLETIONS)


@pytest.mark.parametrize(
    "body",
    [
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]},
        {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]},
        {"messages": [{"role": "user", "content": "hi"}], "chat_template": "{{ 1 }}"},
        {"messages": [{"role": "assistant", "content": None, "tool_calls": []}]},
        {"messages": []},
    ],
    ids=["content-parts", "tools", "own-template", "tool-calls", "empty"],
)
def test_what_only_the_server_can_render_is_left_to_it(tiny: Path, body) -> None:
    tok = LocalTokenizer(tiny)
    assert tok.shape_of(body, CHAT_COMPLETIONS) is None and tok.ids(body, CHAT_COMPLETIONS) is None


async def _router_checked_against(tiny: Path, answer) -> Any:
    """A tokenizer check whose decode's /tokenize is ``answer(body, endpoint)``, after it ran."""
    from pd_proxy.backends.pool import BackendPool
    from pd_proxy.config import ProxyConfig
    from pd_proxy.metrics import ProxyMetrics
    from pd_proxy.routing.cache.metrics import CacheMetrics
    from pd_proxy.routing.tokenizer_check import TokenizerCheck

    async def tokenize(request: web.Request) -> web.Response:
        body = await request.json()
        endpoint = CHAT_COMPLETIONS if "messages" in body else COMPLETIONS
        ids = answer(body, endpoint)
        return web.json_response({"count": len(ids), "max_model_len": 4096, "tokens": ids})

    app = web.Application()
    app.router.add_post("/tokenize", tokenize)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    url = f"http://127.0.0.1:{port}"
    config = ProxyConfig(prefill=(url,), decode=(url,), local_prefill_max_tokens=8)
    metrics = CacheMetrics(ProxyMetrics(config.prefill, config.decode).registry)
    pool = BackendPool("decode", config.decode)
    router = TokenizerCheck(
        LocalTokenizer(tiny),
        pool,
        backend_key=None,
        timeout=config.health_timeout,
        metrics=metrics,
    )
    try:
        async with aiohttp.ClientSession() as session:
            await router.validate(session)
    finally:
        await runner.cleanup()
    return router


async def test_start_check_trusts_each_shape_that_matches_the_server(tiny: Path, hf) -> None:
    router = await _router_checked_against(tiny, lambda b, e: hf_ids(hf, b, e))
    assert router.validated and router.trusted == {COMPLETION, CHAT}
    # The canary set covers every shape the proxy tokenizes itself: none is trusted unchecked.
    assert {shape for shape, _, _ in CANARY} == set(SHAPES)


async def test_a_shape_the_server_renders_otherwise_is_left_to_it(tiny: Path, hf) -> None:
    """A server-side template (vLLM's --chat-template) the files do not have: chat goes to
    /tokenize, completions stay local."""

    def answer(body, endpoint):
        ids = hf_ids(hf, body, endpoint)
        return ids + [7] if endpoint == CHAT_COMPLETIONS else ids

    router = await _router_checked_against(tiny, answer)
    assert router.trusted == {COMPLETION}
    sample = router.metrics.trusted.labels(CHAT)._value.get()
    assert sample == 0
