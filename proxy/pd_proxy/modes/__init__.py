"""The modes of the P/D flow: each a strategy with the ``pd_proxy.legs.Mode`` signature that runs
a request's legs, chosen once at start-up by ``select``.

- ``normal``: prefill for the KV, decode for the whole answer (the default);
- ``first_token``: token 1 from the prefill leg, the rest from decode
  (``--first-token-from-prefill``); requests it cannot serve exactly take the normal mode.

A new mode (a local prefill for conditional disaggregation, a fan-out of prompt lists or n > 1)
is one more module here with the same signature and one more branch in ``select``.
"""

from __future__ import annotations

from pd_proxy.legs import Legs, Mode
from pd_proxy.modes.first_token import FirstTokenMode
from pd_proxy.modes.normal import NormalMode

__all__ = ["FirstTokenMode", "NormalMode", "select"]


def select(legs: Legs) -> Mode:
    """The mode the settings ask for."""
    if legs.config.first_token_from_prefill:
        return FirstTokenMode(legs)
    return NormalMode(legs)
