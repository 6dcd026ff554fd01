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

# Opt-in markers: left out unless ``-m`` names them. ``repeat``: a check run N times over;
# ``slow``: a check beyond `make test`'s time budget (`make test-slow` runs them).
OPT_IN = ("repeat", "slow")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Leave out the opt-in checks unless ``-m`` names their marker, so neither `make test` nor
    `-m e2e` runs them by accident."""
    named = config.option.markexpr or ""
    skipped = [m for m in OPT_IN if m not in named]
    kept = [i for i in items if not any(i.get_closest_marker(m) for m in skipped)]
    if len(kept) != len(items):
        config.hook.pytest_deselected(items=[i for i in items if i not in kept])
        items[:] = kept
