"""Cache-aware P/D on the real local stack, end to end: prefill and decode publish KV
events on loopback (the kit's command builder), pd-proxy follows them and routes by them.

- Follow-up turns: a proxy with ``--local-prefill-max-tokens 64`` sends a long prompt P/D, the same
  prompt plus a few words to decode alone (decode holds the history: path ``local``, reason
  ``cached``; the prefill computes nothing; decode's cache-hit tokens grow by the prefix), and a
  new long prompt P/D again.
- Two decodes: a second decode process (the kit's own command builder, its own ports), a proxy
  over both with ``--prefix-cache-routing events``: requests sharing a prefix land on the decode
  that holds it.
- Predicted hits: a proxy with ``--local-prefill-max-tokens 64`` over the second decode (which
  reports ``cached_tokens``): every request served by decode alone was predicted the hit vLLM
  served, plain and salted; a salted long prompt is routed from its own salt's blocks only (P/D
  the first time although the plain prompt is cached, decode alone the second time).
- A proxy restarted over full caches: started after each decode cached a prefix, it learns what
  each holds from vLLM's replay buffer before it reports ready, and its first requests land where
  a client pinning each prefix would send them, with the same hits.
- Restart (behind ``repeat``): the decode holding a prefix restarts with an empty cache; the proxy
  forgets its index and routes that prefix by load, with the same answer.

Every answer is compared with the same prompt computed from scratch (a unique ``cache_salt``) on
decode alone and through P/D: greedy text identical on every path.
"""

from __future__ import annotations

import dataclasses
import random
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from pcp_pd_kit.localstack.commands import ProcessSpec, proxy_spec, vllm_server_spec
from pcp_pd_kit.localstack.live import post_json, scrape
from pcp_pd_kit.localstack.model_source import tokenizer_folder
from pcp_pd_kit.localstack.process import ManagedProcess, wait_healthy
from pcp_pd_kit.localstack.report import PROMPT_TOKENS_BY_SOURCE, total
from pcp_pd_kit.localstack.stack import Stack, wait_until
from pd_proxy.protocol.endpoints import CHAT_COMPLETIONS, COMPLETIONS

pytestmark = pytest.mark.e2e

# Apart from the shared stack's ports (conftest.E2E_PORTS) and the other e2e proxies.
FOLLOW_PROXY_PORT = 18546
TWO_DECODES_PROXY_PORT = 18547
PREDICTED_PROXY_PORT = 18548
RESTARTED_PROXY_PORT = 18544
SECOND_DECODE_PORTS = {
    "decode_port": 18524,
    "decode_side_channel_port": 18525,
    "decode_kv_events_port": 18526,
    "decode_kv_replay_port": 18527,
}
LOCAL_MAX = 64  # as for follow-up turns: LOCAL_PREFILL_MAX_TOKENS=64 make up
MAX_TOKENS = 8
FEW_WORDS = " and then they went home for dinner"
VOCABULARY = (
    "farmer sold seven eggs each student bought two more books than week before apples left "
    "basket after they ate half noon today river crossed bridge market opened early morning "
    "teacher counted chairs garden grew tall tomatoes children played outside until evening"
).split()


def long_text(seed: str, words: int = 260) -> str:
    """Hundreds of tokens of text no other test sends (seeded by a fresh id)."""
    rng = random.Random(seed)
    return f"Story {seed}: " + " ".join(rng.choice(VOCABULARY) for _ in range(words))


def body(endpoint: str, model: str, text: str, salt: str | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"model": model, "max_tokens": MAX_TOKENS, "temperature": 0.0}
    if endpoint == CHAT_COMPLETIONS:
        out["messages"] = [{"role": "user", "content": text}]
    else:
        out["prompt"] = text
    if salt is not None:
        out["cache_salt"] = salt
    return out


def answer(url: str, endpoint: str, model: str, text: str, salt: str | None = None) -> str:
    reply = post_json(f"{url}{endpoint}", body(endpoint, model, text, salt))
    choice = reply["choices"][0]
    return str(choice["message"]["content"] if "message" in choice else choice["text"])


def from_scratch(url: str, endpoint: str, model: str, text: str) -> str:
    """The greedy answer with nothing cached (a salt no block was stored under)."""
    return answer(url, endpoint, model, text, salt=f"fresh-{uuid.uuid4().hex}")


def prompt_tokens(decode: str, endpoint: str, model: str, text: str) -> int:
    payload = body(endpoint, model, text)
    payload.pop("max_tokens"), payload.pop("temperature")
    return int(post_json(f"{decode}/tokenize", payload)["count"])


@dataclass(frozen=True)
class Counters:
    """What the servers and the proxy counted so far (deltas tell what one request did)."""

    prefill_prompt: float
    decode_hit: dict[str, float]  # per decode URL: vLLM's local_cache_hit prompt tokens
    decode_requests: dict[str, float]
    decisions: dict[tuple[str, str], float]

    @staticmethod
    def read(proxy: str, prefill: str, decodes: list[str]) -> Counters:
        hit, requests = {}, {}
        for url in decodes:
            samples = scrape(url)
            hit[url] = total(samples, PROMPT_TOKENS_BY_SOURCE, source="local_cache_hit") or 0.0
            requests[url] = total(samples, "vllm:request_success_total") or 0.0
        decisions = {
            (s.labels["path"], s.labels["reason"]): s.value
            for s in scrape(proxy)
            if s.name == "pd_proxy_path_decisions_total"
        }
        return Counters(
            total(scrape(prefill), "vllm:prompt_tokens_total") or 0.0, hit, requests, decisions
        )

    def decided(self, before: Counters, path: str, reason: str) -> float:
        return self.decisions.get((path, reason), 0.0) - before.decisions.get((path, reason), 0.0)


def settled(
    proxy: str, prefill: str, decodes: list[str], served: int, before: Counters
) -> Counters:
    """The counters once every decode has counted ``served`` more finished requests (vLLM
    publishes its counters a moment after the answer)."""

    def read() -> Counters | None:
        now = Counters.read(proxy, prefill, decodes)
        done = sum(now.decode_requests[u] - before.decode_requests[u] for u in decodes)
        return now if done >= served else None

    return wait_until(read, 20, "the decodes' request counters", 0.2)


def blocks_followed(proxy: str, backend: str) -> float | None:
    """The blocks the proxy's event index holds for ``backend`` (None: not following it)."""
    for s in scrape(proxy):
        if s.name == "pd_proxy_cache_blocks" and s.labels.get("backend") == backend:
            if s.labels.get("source") == "events":
                return s.value
    return None


def wait_followed(proxy: str, backend: str, at_least: float = 0.0) -> float:
    return wait_until(
        lambda: (n := blocks_followed(proxy, backend)) is not None and n >= at_least and n + 1,
        30,
        f"the proxy's event index of {backend} to hold {at_least:.0f} blocks",
        0.2,
    )


def start_proxy(stack: Stack, name: str, port: int, extra: list[str], **knobs: Any) -> ProcessSpec:
    assert stack.model is not None
    settings = dataclasses.replace(stack.settings, proxy_port=port, **knobs)
    spec = proxy_spec(settings, tokenizer=tokenizer_folder(stack.model.path))
    return dataclasses.replace(spec, name=name, argv=[*spec.argv, *extra])


def running(spec: ProcessSpec, stack: Stack) -> ManagedProcess:
    proc = ManagedProcess(spec, stack.log_dir)
    proc.start()
    try:
        wait_healthy([proc], stack.settings.startup_timeout_s)
    except BaseException:
        proc.stop()
        raise
    return proc


@pytest.fixture(scope="module")
def follow_proxy(pd_stack: Stack) -> Iterator[str]:
    """The stack's pair behind a proxy with LOCAL_PREFILL_MAX_TOKENS=64 and cache-aware
    routing, following decode's events."""
    spec = start_proxy(
        pd_stack,
        "proxy-cache-follow",
        FOLLOW_PROXY_PORT,
        [],
        local_prefill_max_tokens=LOCAL_MAX,
        prefix_cache_routing="events",
    )
    proc = running(spec, pd_stack)
    try:
        url = pd_stack.settings.url(FOLLOW_PROXY_PORT)
        wait_followed(url, pd_stack.urls["decode"])
        yield url
    finally:
        proc.stop()


@pytest.mark.parametrize("endpoint", [COMPLETIONS, CHAT_COMPLETIONS])
def test_follow_up_goes_to_decode_alone_and_new_prompts_go_pd(
    pd_stack: Stack, follow_proxy: str, endpoint: str
) -> None:
    proxy, model = follow_proxy, pd_stack.served_model_name
    prefill, decode = pd_stack.urls["prefill"], pd_stack.urls["decode"]
    block = pd_stack.settings.block_size
    history = long_text(uuid.uuid4().hex[:12])
    follow_up, fresh = history + FEW_WORDS, long_text(uuid.uuid4().hex[:12])
    n_history = prompt_tokens(decode, endpoint, model, history)
    n_follow = prompt_tokens(decode, endpoint, model, follow_up)
    assert n_history > 3 * LOCAL_MAX and 0 < n_follow - n_history <= LOCAL_MAX // 2

    def read() -> Counters:
        return Counters.read(proxy, prefill, [decode])

    # 1. A long prompt, nothing cached: P/D; decode now holds its blocks (pulled over NIXL).
    start, held = read(), blocks_followed(proxy, decode) or 0.0
    answers = {"history": answer(proxy, endpoint, model, history)}
    after_history = settled(proxy, prefill, [decode], 1, start)
    assert after_history.decided(start, "pd", "long") == 1
    assert after_history.prefill_prompt - start.prefill_prompt == n_history
    wait_followed(proxy, decode, held + n_history // block)  # decode's events announced them

    # 2. The same prompt plus a few words: decode alone; the prefill computes nothing.
    answers["follow-up"] = answer(proxy, endpoint, model, follow_up)
    after_follow = settled(proxy, prefill, [decode], 1, after_history)
    assert after_follow.decided(after_history, "local", "cached") == 1
    assert after_follow.prefill_prompt == after_history.prefill_prompt
    hit = after_follow.decode_hit[decode] - after_history.decode_hit[decode]
    # Whole blocks of the history (its last block may re-tokenize differently with the new words).
    assert (n_history // block - 1) * block <= hit < n_follow, hit

    # 3. A new long prompt: P/D again.
    answers["new prompt"] = answer(proxy, endpoint, model, fresh)
    after_fresh = settled(proxy, prefill, [decode], 1, after_follow)
    assert after_fresh.decided(after_follow, "pd", "long") == 1
    assert after_fresh.prefill_prompt > after_follow.prefill_prompt

    # Greedy answers: the same computed from scratch on decode alone and through P/D.
    texts = {"history": history, "follow-up": follow_up, "new prompt": fresh}
    for name, text in texts.items():
        alone = from_scratch(decode, endpoint, model, text)
        pd = from_scratch(pd_stack.urls["proxy"], endpoint, model, text)
        assert answers[name] == alone == pd, (name, answers[name], alone, pd)


@dataclass
class TwoDecodes:
    proxy: str
    decodes: list[str]
    second: ManagedProcess
    second_spec: ProcessSpec


@pytest.fixture(scope="module")
def two_decodes(pd_stack: Stack) -> Iterator[TwoDecodes]:
    """A second decode (the kit's command builder, its own ports and the decode's core) and a
    proxy over both decodes with --prefix-cache-routing events (no local prefill)."""
    assert pd_stack.model is not None
    settings = dataclasses.replace(pd_stack.settings, **SECOND_DECODE_PORTS)
    spec = vllm_server_spec(
        settings, "decode", pd_stack.model.path, pd_stack.served_model_name, pd_stack.repo
    )
    # It reports usage.prompt_tokens_details.cached_tokens (the predicted-hit test reads it).
    spec = dataclasses.replace(
        spec, name="decode-2", argv=[*spec.argv, "--enable-prompt-tokens-details"]
    )
    second = running(spec, pd_stack)
    proxy_proc, two = None, None
    try:
        urls = [pd_stack.urls["decode"], settings.url(settings.decode_port)]
        proxy_proc = running(
            start_proxy(
                pd_stack,
                "proxy-two-decodes",
                TWO_DECODES_PROXY_PORT,
                ["--decode", urls[1]],
                prefix_cache_routing="events",
            ),
            pd_stack,
        )
        proxy = pd_stack.settings.url(TWO_DECODES_PROXY_PORT)
        for url in urls:
            wait_followed(proxy, url)
        two = TwoDecodes(proxy, urls, second, spec)
        yield two
    finally:
        if proxy_proc is not None:
            proxy_proc.stop()
        # The restart test replaces the process: stop the one running now.
        (second if two is None else two.second).stop()


def send_and_count(
    stack: Stack, two: TwoDecodes, texts: list[str]
) -> tuple[list[str], Counters, Counters]:
    """Send ``texts`` one by one through the two-decode proxy: answers, counters before, after."""
    model, prefill = stack.served_model_name, stack.urls["prefill"]
    before = Counters.read(two.proxy, prefill, two.decodes)
    answers = [answer(two.proxy, COMPLETIONS, model, text) for text in texts]
    after = settled(two.proxy, prefill, two.decodes, len(texts), before)
    return answers, before, after


def cache_choices(proxy: str) -> list[float]:
    """The proxy's decode choices made by cache (a list: empty when none was counted)."""
    return [
        s.value
        for s in scrape(proxy)
        if s.name == "pd_proxy_cache_choices_total"
        and s.labels == {"role": "decode", "reason": "cache"}
    ]


def assert_served_as_pinned(
    decodes: list[str],
    model: str,
    block: int,
    prefixes: list[str],
    answers: dict[str, str],
    before: Counters,
    after: Counters,
) -> None:
    """Decode i, holding prefix i, served that prefix's follow-ups, as many as the others, with
    a client pinning each prefix's hits (every whole block but the last); every answer is the
    prompt's answer computed from scratch."""
    each = len(answers) // len(prefixes)
    for url, prefix in zip(decodes, prefixes, strict=True):
        served = after.decode_requests[url] - before.decode_requests[url]
        hit = after.decode_hit[url] - before.decode_hit[url]
        n = prompt_tokens(url, COMPLETIONS, model, prefix)
        assert served == each, (url, served)
        assert hit >= each * (n // block - 1) * block, (url, hit, n)
    for text, got in answers.items():
        assert got == from_scratch(decodes[0], COMPLETIONS, model, text)


def test_same_prefix_requests_land_on_the_decode_holding_it(
    pd_stack: Stack, two_decodes: TwoDecodes
) -> None:
    two, model, block = two_decodes, pd_stack.served_model_name, pd_stack.settings.block_size
    prefixes = [long_text(uuid.uuid4().hex[:12]) for _ in two.decodes]
    # Each decode computes one prefix itself (sent to it directly) and announces its blocks.
    for url, prefix in zip(two.decodes, prefixes, strict=True):
        held = blocks_followed(two.proxy, url) or 0.0
        answer(url, COMPLETIONS, model, prefix)
        n = prompt_tokens(url, COMPLETIONS, model, prefix)
        wait_followed(two.proxy, url, held + n // block)
    # Interleaved follow-ups of both prefixes, through the proxy (P/D: no local prefill here).
    texts = [prefixes[i % 2] + f" question {i} about the story" for i in range(6)]
    answers, before, after = send_and_count(pd_stack, two, texts)
    assert cache_choices(two.proxy) == [6.0]
    assert_served_as_pinned(
        two.decodes, model, block, prefixes, dict(zip(texts, answers, strict=True)), before, after
    )


def test_a_restarted_proxy_routes_its_first_requests_by_what_the_decodes_hold(
    pd_stack: Stack, two_decodes: TwoDecodes
) -> None:
    two, model, block = two_decodes, pd_stack.served_model_name, pd_stack.settings.block_size
    prefill = pd_stack.urls["prefill"]
    prefixes = [long_text(uuid.uuid4().hex[:12]) for _ in two.decodes]
    for url, prefix in zip(two.decodes, prefixes, strict=True):
        answer(url, COMPLETIONS, model, prefix)  # each decode caches one prefix, then goes quiet
    spec = start_proxy(
        pd_stack,
        "proxy-restarted",
        RESTARTED_PROXY_PORT,
        ["--decode", two.decodes[1]],
        prefix_cache_routing="events",
    )
    proc = running(spec, pd_stack)  # healthy = ready: every decode's publisher replayed
    try:
        proxy = pd_stack.settings.url(RESTARTED_PROXY_PORT)
        # Both follow-ups of one prefix, then both of the other: routing by load would send the
        # first two to different decodes.
        texts = [prefixes[i // 2] + f" question {i} after the restart" for i in range(4)]
        before = Counters.read(proxy, prefill, two.decodes)
        answers = [answer(proxy, COMPLETIONS, model, text) for text in texts]
        after = settled(proxy, prefill, two.decodes, len(texts), before)
        assert cache_choices(proxy) == [4.0]
        assert_served_as_pinned(
            two.decodes,
            model,
            block,
            prefixes,
            dict(zip(texts, answers, strict=True)),
            before,
            after,
        )
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def predicting_proxy(pd_stack: Stack, two_decodes: TwoDecodes) -> Iterator[str]:
    """The stack's prefill and the second decode behind a proxy with
    LOCAL_PREFILL_MAX_TOKENS=64 and cache-aware routing."""
    spec = start_proxy(
        pd_stack,
        "proxy-cache-predicted",
        PREDICTED_PROXY_PORT,
        [],
        local_prefill_max_tokens=LOCAL_MAX,
        prefix_cache_routing="events",
        decode_port=SECOND_DECODE_PORTS["decode_port"],
    )
    proc = running(spec, pd_stack)
    try:
        url = pd_stack.settings.url(PREDICTED_PROXY_PORT)
        wait_followed(url, two_decodes.decodes[1])
        yield url
    finally:
        proc.stop()


def predicted(proxy: str) -> float:
    return total(scrape(proxy), "pd_proxy_cache_predicted_hit_tokens_total", role="decode") or 0.0


@pytest.mark.parametrize("endpoint", [COMPLETIONS, CHAT_COMPLETIONS])
def test_predicted_hits_are_vllms_cached_tokens_plain_and_salted(
    pd_stack: Stack, two_decodes: TwoDecodes, predicting_proxy: str, endpoint: str
) -> None:
    """The proxy's predicted hit equals vLLM's cached_tokens on every request decode serves
    alone; a salted prompt is predicted only from blocks stored under its own salt."""
    proxy, model, decode = predicting_proxy, pd_stack.served_model_name, two_decodes.decodes[1]
    prefill, block = pd_stack.urls["prefill"], pd_stack.settings.block_size
    history = long_text(uuid.uuid4().hex[:12])
    follow_up, salt = history + FEW_WORDS, f"tenant-{uuid.uuid4().hex[:8]}"
    n_history = prompt_tokens(decode, endpoint, model, history)

    def send(text: str, salt: str | None = None) -> tuple[dict[str, Any], float, Counters]:
        """The answer, the hit the proxy predicted for it, and the counters after it."""
        before = Counters.read(proxy, prefill, [decode])
        guess = predicted(proxy)
        reply = post_json(f"{proxy}{endpoint}", body(endpoint, model, text, salt))
        after = settled(proxy, prefill, [decode], 1, before)
        return reply, predicted(proxy) - guess, after

    def cached(reply: dict[str, Any]) -> int:
        return int(reply["usage"]["prompt_tokens_details"]["cached_tokens"])

    # The plain history P/D (decode pulls it); its follow-up to decode alone, predicted exactly.
    held = blocks_followed(proxy, decode) or 0.0
    _, _, start = send(history)
    wait_followed(proxy, decode, held + n_history // block)
    reply, guess, after = send(follow_up)
    assert after.decided(start, "local", "cached") == 1
    assert guess == cached(reply) >= (n_history // block - 1) * block, (guess, reply["usage"])

    # The salted follow-up, the plain prompt cached: nothing under its salt, so P/D.
    held = blocks_followed(proxy, decode) or 0.0
    reply, guess, salted = send(follow_up, salt)
    assert salted.decided(after, "pd", "long") == 1 and guess == 0
    assert salted.prefill_prompt > after.prefill_prompt
    wait_followed(proxy, decode, held + n_history // block)  # decode stored it under the salt
    # The second time, decode holds it under this salt: decode alone, predicted exactly.
    reply, guess, again = send(follow_up, salt)
    assert again.decided(salted, "local", "cached") == 1 and again.prefill_prompt == (
        salted.prefill_prompt
    )
    assert guess == cached(reply) > 0, (guess, reply["usage"])
    # Another salt still shares nothing with either.
    _, guess, other = send(follow_up, f"other-{salt}")
    assert other.decided(again, "pd", "long") == 1 and guess == 0


def decode_choices(proxy: str) -> dict[str, float]:
    return {
        s.labels["reason"]: s.value
        for s in scrape(proxy)
        if s.name == "pd_proxy_cache_choices_total" and s.labels.get("role") == "decode"
    }


@pytest.mark.repeat
def test_a_restarted_decode_is_forgotten_and_routing_stays_right(
    pd_stack: Stack, two_decodes: TwoDecodes
) -> None:
    """The second decode holds a prefix, then restarts (empty cache, event sequence from 0): the
    proxy drops what it knew of it, so the prefix's follow-up is placed by load, not sent to a
    cache that is gone, and computed whole; the answer stays the greedy one."""
    two, model, block = two_decodes, pd_stack.served_model_name, pd_stack.settings.block_size
    prefix = long_text(uuid.uuid4().hex[:12])
    held = blocks_followed(two.proxy, two.decodes[1]) or 0.0
    answer(two.decodes[1], COMPLETIONS, model, prefix)
    n = prompt_tokens(two.decodes[1], COMPLETIONS, model, prefix)
    wait_followed(two.proxy, two.decodes[1], held + n // block)
    two.second.stop()
    two.second = running(two.second_spec, pd_stack)
    # The proxy saw it down (health check), dropped its index, and follows the new one from 0.
    wait_until(
        lambda: (b := blocks_followed(two.proxy, two.decodes[1])) is not None and b < n // block,
        60,
        "the proxy to forget the restarted decode's blocks",
        0.5,
    )
    text = prefix + " question about the story"
    choices = decode_choices(two.proxy)
    answers, before, after = send_and_count(pd_stack, two, [text])
    now = decode_choices(two.proxy)
    assert now["cache"] == choices["cache"] and now["load"] == choices["load"] + 1
    assert sum(after.decode_hit[u] - before.decode_hit[u] for u in two.decodes) == 0
    assert answers[0] == from_scratch(two.decodes[0], COMPLETIONS, model, text)
