"""The kit's documented defaults: .env.example only, never the developer's own .env."""

from __future__ import annotations

import dataclasses
from functools import cache

from pcp_pd_kit.settings import StackSettings, read_env_file, settings_from_env
from tests.support.paths import ENV_EXAMPLE


@cache
def _example() -> dict[str, str]:
    return read_env_file(ENV_EXAMPLE)


def example_env() -> dict[str, str]:
    """A fresh copy of .env.example's KEY=VALUE pairs, as Compose and the kit read them."""
    return dict(_example())


def example_settings(**overrides: object) -> StackSettings:
    """The local stack's settings from .env.example, with some fields replaced."""
    return dataclasses.replace(settings_from_env(example_env()), **overrides)  # type: ignore[arg-type]
