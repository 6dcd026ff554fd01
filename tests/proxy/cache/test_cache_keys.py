"""The block-key chain's contract, held by both implementations: the C one pd-proxy uses
(``_chain.c``, built by ``make install`` and by the proxy image) and the Python fallback. Each
test calls both; neither is skipped (the bootstrap fails where the C one does not build)."""

from __future__ import annotations

import random
import sys
from collections.abc import Callable, Sequence

import pytest

from pd_proxy.routing.cache import holders, keys
from pd_proxy.routing.cache._chain import chain as native_chain
from pd_proxy.routing.cache.index import ReplicaIndex
from pd_proxy.routing.cache.keys import KEY_MASK, ROOT, Extra, Key, python_chain

from .test_cache_index import feed
from .vllm_events import BLOCK, blocks, stored

Chain = Callable[..., list[Key]]


def _native(
    tokens: Sequence[int], size: int, parent: Key = ROOT, extras: Sequence[Extra] | None = None
) -> list[Key]:
    return native_chain(tokens, size, parent, extras or None)


IMPLEMENTATIONS = {"c": _native, "python": python_chain}


@pytest.fixture(params=sorted(IMPLEMENTATIONS))
def chain(request: pytest.FixtureRequest) -> Chain:
    return IMPLEMENTATIONS[request.param]


def _random_prompt(rng: random.Random) -> tuple[list[int], int, list[Extra]]:
    size = rng.choice([1, 2, 16, 17])
    ids = [rng.randrange(50_000) for _ in range(rng.randint(0, 6 * size + 3))]
    n = len(ids) // size
    extras: list[Extra] = [rng.choice([None, (("salt", "s"),), (("lora", "a"),)]) for _ in range(n)]
    return ids, size, extras[: rng.randint(0, n)]  # shorter: the rest plain


def test_pd_proxy_uses_the_c_chain() -> None:
    """``keys.chain`` is the C one: its keys are the C function's, not the Python ones; the
    role index's walk reads its masks in C too."""
    ids = blocks(3)
    assert keys.NATIVE and holders._runs is not None
    assert keys.chain(ids, BLOCK) == native_chain(ids, BLOCK, ROOT, None)
    assert keys.chain(ids, BLOCK) != python_chain(ids, BLOCK)


def test_one_key_per_whole_block_within_sixty_bits(chain: Chain) -> None:
    rng = random.Random(1)
    for _ in range(200):
        ids, size, extras = _random_prompt(rng)
        got = chain(ids, size, extras=extras)
        assert len(got) == len(ids) // size
        assert all(0 <= k <= KEY_MASK for k in got)


def test_a_chain_split_on_a_block_boundary_continues_from_its_last_key(chain: Chain) -> None:
    """Events store a prompt in pieces, each from its parent's key: the pieces' keys are the
    whole prompt's, and a prefix's keys lead the prompt's."""
    rng = random.Random(2)
    for _ in range(200):
        ids, size, extras = _random_prompt(rng)
        whole = chain(ids, size, extras=extras)
        cut = rng.randint(0, len(whole))
        head = chain(ids[: cut * size], size, extras=extras[:cut])
        tail = chain(ids[cut * size :], size, head[-1] if head else ROOT, extras[cut:])
        assert head == whole[:cut] and head + tail == whole


def test_a_key_depends_on_every_token_before_it_and_on_nothing_after(chain: Chain) -> None:
    rng = random.Random(3)
    ids = [rng.randrange(50_000) for _ in range(16 * 8)]
    base = chain(ids, 16)
    for pos in (0, 5, 16, 63, 127):
        changed = list(ids)
        changed[pos] += 1
        got = chain(changed, 16)
        block = pos // 16
        assert got[:block] == base[:block]
        assert all(a != b for a, b in zip(got[block:], base[block:], strict=True))


def test_block_order_block_size_and_extra_keys_all_count(chain: Chain) -> None:
    a, b = list(range(100, 116)), list(range(200, 216))
    assert chain(a + b, 16)[1] != chain(b + a, 16)[1]
    assert chain(a + b, 16)[0] not in chain(a + b, 8)
    salted: list[Extra] = [None, (("salt", "x"),)]
    plain, salt = chain(a + b, 16), chain(a + b, 16, extras=salted)
    assert salt[0] == plain[0] and salt[1] != plain[1]
    assert chain(a + b, 16, extras=[(("salt", "x"),)])[1] != salt[1]
    assert len(set(chain(list(range(16 * 4096)), 16))) == 4096


def test_any_int_is_a_token(chain: Chain) -> None:
    """Token ids are JSON integers: negative ones and ones past 64 bits key like any other."""
    odd = [-1, 2**63, -(2**64) - 5, sys.maxsize, 0, 7, 2**200, 3]
    got = chain(odd, 4)
    assert len(got) == 2 and len(set(got)) == 2
    assert got == chain(list(odd), 4) and chain(odd[:4] + [9, 9, 9, 9], 4)[0] == got[0]


def test_the_c_chain_refuses_what_is_not_a_token() -> None:
    with pytest.raises(TypeError):
        native_chain([1, 2, "3", 4], 2, ROOT, None)
    with pytest.raises(ValueError, match="block_size"):
        native_chain([1, 2], 0, ROOT, None)
    assert native_chain((t for t in range(8)), 4, ROOT, None) == native_chain(
        list(range(8)), 4, ROOT, None
    )


@pytest.mark.vllm  # the events are encoded by vLLM's own classes
@pytest.mark.parametrize("native", [True, False], ids=["c", "python"])
def test_the_index_and_a_request_meet_on_either_chain(
    native: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The events index and the router key blocks with the same ``keys.chain``, whichever it
    is: a prompt stored in two events matches its request's chain, a salted one does not."""
    if not native:
        monkeypatch.setattr(keys, "_native_chain", None)
    prompt = blocks(3)
    index = ReplicaIndex()
    feed(index, 0, stored([b"a", b"b"], None, prompt[: 2 * BLOCK]))
    feed(index, 1, stored([b"c"], b"b", prompt[2 * BLOCK :]))
    assert index.match(keys.chain(prompt, BLOCK)) == 3
    assert index.match(keys.chain(prompt, BLOCK, extras=[(("salt", "s"),)])) == 0
    assert (keys.chain(prompt, BLOCK) == native_chain(prompt, BLOCK, ROOT, None)) is native
