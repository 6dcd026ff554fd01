"""The modes of the P/D flow: each a strategy with the ``pd_proxy.legs.Mode`` signature that runs
a request's legs, chosen once at start-up by ``select``.

- ``normal``: prefill for the KV, decode for the whole answer (the default);
- ``first_token``: token 1 from the prefill leg, the rest from decode
  (``--first-token-from-prefill``); requests it cannot serve exactly take the normal mode;
- ``by_shape``: in front of either, the request's shape decides first (pd_proxy.shapes): refused,
  ``decode_alone`` (also short prompts under ``--local-prefill-max-tokens``), ``fanout`` (one
  P/D request per choice), or the P/D mode.

A new mode is one more module here with the same signature and one more branch in ``select``.
"""

from __future__ import annotations

from pd_proxy.legs import Legs, Mode
from pd_proxy.modes.by_shape import ByShapeMode
from pd_proxy.modes.first_token import FirstTokenMode
from pd_proxy.modes.normal import NormalMode

__all__ = ["ByShapeMode", "FirstTokenMode", "NormalMode", "pd_mode", "select"]


def pd_mode(legs: Legs) -> NormalMode | FirstTokenMode:
    """The P/D mode the settings ask for."""
    if legs.config.first_token_from_prefill:
        return FirstTokenMode(legs)
    return NormalMode(legs)


def select(legs: Legs) -> Mode:
    """The mode a request goes to: its shape first, then the P/D mode."""
    return ByShapeMode(legs, pd_mode(legs))
