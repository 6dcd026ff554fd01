"""The eval's per-request timeout (EVAL_REQUEST_TIMEOUT_S / --request-timeout): lm-eval gets it,
and it must be longer than the kit proxy's limits (pd_proxy.timeouts) from the same settings."""

from __future__ import annotations

import pytest

from pcp_pd_kit.gsm8k import EvalError, cli, harness
from pcp_pd_kit.settings import kit_env


def test_default_comes_from_env_example_and_reaches_lm_eval() -> None:
    settings = cli.parse([], kit_env({}))
    assert settings is not None and settings.request_timeout == "600"
    args = harness.model_args("m", "http://p:8000/", 4, 64, int(settings.request_timeout))
    assert args["timeout"] == 600


def test_flag_wins_and_must_outlast_the_proxy() -> None:
    env = kit_env({})
    settings = cli.parse(["--request-timeout", "900"], env)
    assert settings is not None and settings.request_timeout == "900"
    with pytest.raises(EvalError) as err:
        cli.parse(["--request-timeout", "300"], env)  # the proxy may take 3 + 300 + 26 s
    message = str(err.value)
    assert message.startswith("--request-timeout/EVAL_REQUEST_TIMEOUT_S=300 s is not longer")
    assert "PROXY_PREFILL_TIMEOUT_S=300 s" in message and "= 329 s" in message
    with pytest.raises(EvalError, match="EVAL_REQUEST_TIMEOUT_S=300 s"):
        cli.parse([], {**env, "EVAL_REQUEST_TIMEOUT_S": "300"})
    assert cli.parse([], {**env, "EVAL_REQUEST_TIMEOUT_S": "300", "PROXY_PREFILL_TIMEOUT_S": "60"})


@pytest.mark.parametrize("value", ["0", "-5", "1.5", "soon"])
def test_a_bad_value_is_named(value: str) -> None:
    with pytest.raises(EvalError, match="--request-timeout must be a positive integer"):
        cli.parse(["--request-timeout", value], kit_env({}))


def test_without_the_kits_proxy_settings_nothing_is_compared() -> None:
    env = {k: v for k, v in kit_env({}).items() if not k.startswith("PROXY_") or k == "PROXY_PORT"}
    settings = cli.parse(["--request-timeout", "5"], env)
    assert settings is not None and settings.request_timeout == "5"
