"""Whether a prompt is token ids: a list of JSON integers, booleans not (an empty list is). The
request's shape and its token count both ask it of every completions prompt given as ids.

The check is the C part's (``_chain.c``: one type test per id, about 5 us for 8k ids) where it was
built, else ``set(map(type))`` (about 150 us for 8k: a set insertion per id, paid by every
completions request whose prompt is ids, routed or not). Either way the list last found to be
ids is not read again (by identity: the proxy never changes a client's prompt). ``NATIVE`` says
which.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeGuard

_native: Callable[[object], bool] | None
try:
    from pd_proxy.routing.cache._chain import token_ids as _native
except ImportError:  # no C compiler where the package was built
    _native = None

NATIVE = _native is not None
_INT_TYPE = frozenset({int})


def python_is_ids(value: object) -> bool:
    """The fallback: one pass in C (``map(type)``), a set insertion per id."""
    return isinstance(value, list) and set(map(type, value)) <= _INT_TYPE


def is_token_ids(value: Any) -> TypeGuard[list[int]]:
    if value is _last_ids[0]:
        return True
    if (python_is_ids if _native is None else _native)(value):
        _last_ids[0] = value
        return True
    return False


# The last list is_token_ids accepted (one request's prompt); at first no list at all (with None
# there, ``None`` itself passed as ids until a first prompt of ids came).
_last_ids: list[Any] = [object()]
