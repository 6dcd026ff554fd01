"""Whether a prompt is token ids (pd_proxy.routing.token_ids): the C check pd-proxy uses and the
Python fallback give the same answers, and a prompt asked twice is checked once."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable

import pytest

from pd_proxy.routing import token_ids
from pd_proxy.routing.cache._chain import token_ids as native_check
from pd_proxy.routing.token_ids import is_token_ids, python_is_ids

CHECKS: dict[str, Callable[[object], bool]] = {"c": native_check, "python": python_is_ids}


@pytest.fixture(params=sorted(CHECKS))
def check(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setattr(token_ids, "_native", native_check if request.param == "c" else None)
    monkeypatch.setattr(token_ids, "_last_ids", [object()])  # as a proxy starts
    return str(request.param)


class IntLike(int):
    """An int subclass: JSON never makes one, and vLLM's pydantic would not take it as is."""


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ([1, 2, 3], True),
        ([], True),
        ([0, -1, 1 << 70], True),  # any JSON integer: the server says whether it is in range
        ([1, True, 3], False),  # JSON true is no token id
        ([1, 2.0], False),
        ([1, "2"], False),
        ([1, None], False),
        ([1, IntLike(2)], False),
        ([[1, 2]], False),  # a batch of id lists is another shape
        ((1, 2, 3), False),  # JSON makes lists
        ("1 2 3", False),
        (None, False),
    ],
)
def test_token_ids_are_json_integers_only(check: str, value: object, expected: bool) -> None:
    assert is_token_ids(value) is expected
    assert CHECKS[check](value) is expected


def test_nothing_passes_before_a_first_prompt_of_ids() -> None:
    """A fresh process: a chat request's missing prompt (None) is no prompt of ids (it once
    passed, as the remembered last prompt, until a first prompt of ids came)."""
    probe = (
        "from pd_proxy.routing.token_ids import is_token_ids\n"
        "print(is_token_ids(None), is_token_ids([1]), is_token_ids(None))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.split() == ["False", "True", "False"]


def test_pd_proxy_checks_in_c() -> None:
    assert token_ids.NATIVE and token_ids._native is native_check


def test_a_prompt_checked_twice_is_read_once_and_no_other_list_rides_on_it(
    check: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The request shape and the token count both ask of one prompt: the second asks free."""
    calls: list[object] = []
    inner = CHECKS[check]

    def counted(value: object) -> bool:
        calls.append(value)
        return inner(value)

    if check == "c":
        monkeypatch.setattr(token_ids, "_native", counted)
    else:
        monkeypatch.setattr(token_ids, "python_is_ids", counted)
    ids = [5, 6, 7]
    assert is_token_ids(ids) and is_token_ids(ids) and len(calls) == 1
    assert not is_token_ids([5, 6.0]) and not is_token_ids([True]) and not is_token_ids(None)
    assert is_token_ids([5, 6]) and is_token_ids(ids) and len(calls) == 6
