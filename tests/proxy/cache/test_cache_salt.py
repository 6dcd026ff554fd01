"""Extra keys in the proxy's block keys: a salted prompt is predicted only from blocks stored
under its own salt, a LoRA adapter's only from its own, multimodal ones never. The events are
made by vLLM 0.32's own classes and its own extra-keys functions, so the keys the index builds
from them and the keys a request body gives must meet exactly where vLLM's hashes do."""

from __future__ import annotations

from typing import Any

import pytest

from pd_proxy.protocol.endpoints import CHAT_COMPLETIONS, COMPLETIONS
from pd_proxy.routing.cache.approx import ApproxIndex
from pd_proxy.routing.cache.events import decode
from pd_proxy.routing.cache.extra import PLAIN, UNKEYABLE, RequestKeys, request_keys
from pd_proxy.routing.cache.index import ReplicaIndex
from pd_proxy.routing.cache.keys import chain
from pd_proxy.routing.cache.pending import PendingIndex
from pd_proxy.testing.fake_model import tokenize

from .vllm_events import BLOCK, blocks, frames, stored, vllm_extra_keys

pytestmark = pytest.mark.vllm  # the events are encoded by vLLM's own classes

N = 3  # blocks per prompt


def index_of(*events: Any) -> ReplicaIndex:
    index = ReplicaIndex()
    index.apply(decode(frames(0, *events)))
    return index


def stored_as(salt: str | None = None, lora: str | None = None, mm=()) -> Any:
    """A prompt of N blocks as vLLM stores it for a request with these extra keys."""
    extra = vllm_extra_keys(N, salt=salt, lora=lora, mm=mm)
    fields: dict[str, Any] = {"extra_keys": extra}
    if lora is not None:
        fields.update(lora_name=lora, lora_id=1)
    return stored([f"h{i}".encode() for i in range(N)], None, blocks(N), **fields)


def request(index: ReplicaIndex, keys: RequestKeys) -> list[int]:
    """The request's key chain as the router builds it (adapters as the index learned them)."""
    return chain(blocks(N), BLOCK, extras=keys.extras(N, lambda m: m in index.holders.adapters))


@pytest.mark.parametrize(
    ("stored_under", "asked", "matched"),
    [
        ({}, PLAIN, N),
        ({}, RequestKeys(salt="a"), 0),  # a plain prompt's blocks are not a salted one's
        ({"salt": "a"}, PLAIN, 0),
        ({"salt": "a"}, RequestKeys(salt="a"), N),  # only the first block has the salt
        ({"salt": "a"}, RequestKeys(salt="b"), 0),
        ({"salt": "a"}, RequestKeys(salt="a", model="base"), N),  # the base model: no adapter
        ({"lora": "ad"}, RequestKeys(model="ad"), N),  # every block has the adapter
        ({"lora": "ad"}, RequestKeys(model="base"), 0),
        ({"lora": "ad", "salt": "a"}, RequestKeys(salt="a", model="ad"), N),
        ({"lora": "ad", "salt": "a"}, RequestKeys(model="ad"), 0),
        ({"lora": "ad"}, RequestKeys(model="ad", salt="a"), 0),
        ({"mm": [("img", 2, 5)]}, PLAIN, 0),  # image blocks: never a text prompt's
    ],
)
def test_events_and_requests_meet_under_the_same_extra_keys(stored_under, asked, matched) -> None:
    index = index_of(stored_as(**stored_under))
    assert index.match(request(index, asked)) == matched


def test_a_salted_chain_continues_in_a_later_event() -> None:
    """vLLM stores a long prompt in several events: the salt is in the first block only, and
    the later blocks chain from the salted parent, so they stay apart from the plain prompt's."""
    ids = blocks(2 * N)
    first = stored(
        [b"a0", b"a1", b"a2"], None, ids[: N * BLOCK], extra_keys=vllm_extra_keys(N, "s")
    )
    rest = vllm_extra_keys(N, "s", first_block=N)
    later = stored([b"a3", b"a4", b"a5"], b"a2", ids[N * BLOCK :], extra_keys=rest)
    index = index_of(first, later)
    salted = RequestKeys(salt="s").extras(2 * N, lambda m: False)
    assert index.match(chain(ids, BLOCK, extras=salted)) == 2 * N
    assert index.match(chain(ids, BLOCK)) == 0


def test_pending_and_approximate_entries_are_keyed_by_salt() -> None:
    """What the proxy records itself (pending, approximate) uses the request's keys, so a
    salted request recorded there is no hit for the plain prompt or another salt."""
    ids = blocks(N)

    def keys(salt: str | None) -> list[int]:
        return chain(ids, BLOCK, extras=RequestKeys(salt=salt).extras(N, lambda m: False))

    pending, approx = PendingIndex(), ApproxIndex(100)
    pending.record("r", keys("a"), now=0.0)
    approx.record("r", keys("a"))
    for salt, expected in ((None, 0), ("b", 0), ("a", N)):
        assert pending.match("r", keys(salt), now=1.0) == expected
        assert approx.match("r", keys(salt)) == expected


@pytest.mark.parametrize(
    ("endpoint", "body", "expected"),
    [
        (COMPLETIONS, {"model": "m", "prompt": "x"}, RequestKeys(model="m")),
        (COMPLETIONS, {"model": "m", "prompt": "x", "cache_salt": "t1"}, RequestKeys("t1", "m")),
        (COMPLETIONS, {"prompt": "x", "cache_salt": ""}, PLAIN),  # vLLM: empty is no salt
        (COMPLETIONS, {"prompt": "x", "cache_salt": 7}, UNKEYABLE),
        (COMPLETIONS, {"prompt_embeds": "Zm9v"}, UNKEYABLE),
        (
            CHAT_COMPLETIONS,
            {"messages": [{"role": "user", "content": "x"}], "cache_salt": "t"},
            RequestKeys("t"),
        ),
        (
            CHAT_COMPLETIONS,
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]},
            PLAIN,
        ),
        (
            CHAT_COMPLETIONS,
            {
                "messages": [
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}
                ]
            },
            UNKEYABLE,
        ),
    ],
)
def test_request_keys_from_the_body(endpoint, body, expected) -> None:
    assert request_keys(body) == expected


# Through the real proxy on fake backends: the route the planner takes for salted requests.


def hold(stack, prompt: str, salt: str | None = None) -> None:
    """The decode's index holds ``prompt``'s whole blocks, stored under ``salt``."""
    from pd_proxy.routing.cache.index import ReplicaIndex

    ids = tokenize(prompt)
    n = len(ids) // 4
    extra = vllm_extra_keys(n, salt=salt)
    event = stored(
        [f"{salt}{i}".encode() for i in range(n)], None, ids[: n * 4], 4, extra_keys=extra
    )
    known = stack.running.pipeline.planner.cache.known
    index = known.indexes.setdefault(stack.decodes[0].url, [ReplicaIndex()])[0]
    index.apply(decode(frames(index.expected or 0, event)))


def text(words: int) -> str:
    return " ".join(f"w{i}" for i in range(words))


async def test_a_salted_follow_up_is_routed_from_its_own_salt_only() -> None:
    """The plain history cached on decode: its salted follow-up goes P/D (nothing held under
    the salt), predicted 0; once decode holds the salted history, the salted follow-up goes
    to decode alone with the salted blocks predicted; content it cannot key is never predicted."""
    from tests.proxy.proxy_harness import pd_stack

    async with pd_stack(prefix_cache_routing="events", local_prefill_max_tokens=8) as s:
        s.decode.knobs.plain_requests = True
        history = text(60)
        whole = len(tokenize(history)) // 4 * 4

        async def send(salt: str | None) -> float:
            before = s.sample("pd_proxy_cache_predicted_hit_tokens_total", {"role": "decode"})
            body: dict[str, Any] = {"prompt": f"{history} and more", "max_tokens": 2}
            if salt is not None:
                body["cache_salt"] = salt
            status, _, raw = await s.post(COMPLETIONS, body)
            assert status == 200, raw
            after = s.sample("pd_proxy_cache_predicted_hit_tokens_total", {"role": "decode"})
            return (after or 0.0) - (before or 0.0)

        hold(s, history)
        assert await send("tenant-a") == 0 and len(s.prefill.seen) == 1  # P/D
        assert s.prefill.seen[-1].body["cache_salt"] == "tenant-a"
        assert await send(None) == whole and len(s.prefill.seen) == 1  # plain: decode alone
        hold(s, history, salt="tenant-a")
        assert await send("tenant-a") == whole and len(s.prefill.seen) == 1
        assert await send("tenant-b") == 0 and len(s.prefill.seen) == 2
        # Content the proxy cannot key (an image, prompt embeds): no hit predicted, none recorded.
        router = s.running.pipeline.planner.cache
        route = router.route(tokenize(f"{history} and more"), 8, UNKEYABLE)
        assert (route.path, route.reason, route.decode_hit) == ("pd", "long", 0)
