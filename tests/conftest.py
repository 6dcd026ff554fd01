"""Suite-wide settings for the tests.

The kit commands the tests start read .env.example and the environment, never the developer's own
.env (KIT_DOTENV set but empty), and the shared helper modules' asserts get pytest's detailed
failure messages too.
"""

import os

import pytest

os.environ["KIT_DOTENV"] = ""

pytest.register_assert_rewrite(
    "tests.support", "tests.compose.checks", "tests.k8s.checks", "tests.preflight.fake_host"
)

REPEAT = "repeat"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Leave out the slow repeat checks (marker ``repeat``) unless ``-m`` names them, so neither
    `make test` nor `-m e2e` runs them by accident."""
    if REPEAT in (config.option.markexpr or ""):
        return
    kept = [item for item in items if item.get_closest_marker(REPEAT) is None]
    if len(kept) != len(items):
        config.hook.pytest_deselected(items=[i for i in items if i not in kept])
        items[:] = kept
