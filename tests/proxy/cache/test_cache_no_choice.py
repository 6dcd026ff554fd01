"""Cache-aware routing costs nothing where there is nothing to decide: one prefill, one decode and
no ``--local-prefill-max-tokens`` send every request P/D to the only replicas, so the proxy must
not tokenize the prompt (a decode ``/tokenize`` round trip, 3-5 ms here, on every request). A
second replica, or a limit to apply, brings the token ids back."""

from __future__ import annotations

import pytest

from pd_proxy.protocol.endpoints import COMPLETIONS

from .test_cache_routing import decisions, text

TOKENIZER_SOURCES = ("local", "server", "ids", "none")


def tokenized(stack) -> float:
    return sum(
        stack.sample("pd_proxy_tokenizer_requests_total", {"source": source}) or 0.0
        for source in TOKENIZER_SOURCES
    )


@pytest.mark.parametrize("mode", ["events", "approx", "auto"])
async def test_one_replica_per_role_and_no_limit_tokenizes_nothing(mode: str) -> None:
    from tests.proxy.proxy_harness import pd_stack

    async with pd_stack(prefix_cache_routing=mode) as s:
        for i in range(3):
            status, _, raw = await s.post(COMPLETIONS, {"prompt": text(40, i), "max_tokens": 2})
            assert status == 200, raw
        assert s.decode.tokenize_requests == 0
        assert tokenized(s) == 0
        assert decisions(s, "pd", "no_choice") == 3
        assert len(s.prefill.seen) == 3


@pytest.mark.parametrize(
    ("shape", "options"),
    [
        ({"decodes": 2}, {}),
        ({"prefills": 2}, {}),
        ({}, {"local_prefill_max_tokens": 8}),
    ],
    ids=["two decodes", "two prefills", "a local-prefill limit"],
)
async def test_a_choice_to_make_tokenizes_each_request(shape, options) -> None:
    from tests.proxy.proxy_harness import pd_stack

    async with pd_stack(prefix_cache_routing="auto", **shape, **options) as s:
        for i in range(3):
            status, _, raw = await s.post(COMPLETIONS, {"prompt": text(40, i), "max_tokens": 2})
            assert status == 200, raw
        assert sum(d.tokenize_requests for d in s.decodes) == 3
        assert decisions(s, "pd", "no_choice") == 0
