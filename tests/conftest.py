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
