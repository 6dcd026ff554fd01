"""The KV lease, pd-proxy's limits and the eval's timeout in the kit's settings: .env.example's
defaults agree (pinned here), the local stack refuses settings that do not, and the local proxy
gets the limits and the lease it then checks itself."""

from __future__ import annotations

import pytest

from pcp_pd_kit.localstack.commands import proxy_spec
from pcp_pd_kit.settings import SettingsError, proxy_limits, settings_from_env
from pd_proxy.config import load_config
from pd_proxy.timeouts import KIT_NAMES, timeout_problems
from tests.support.env import example_env, example_settings


def test_env_example_defaults_agree() -> None:
    env = example_env()
    lease = float(env["NIXL_KV_LEASE_S"])
    settings = settings_from_env(env)
    limits = proxy_limits(settings)
    client = float(env["EVAL_REQUEST_TIMEOUT_S"])
    assert timeout_problems(lease, limits, client_s=client, names=KIT_NAMES) == []
    # With a margin a loaded machine can live with: the proxy gives up on a silent decode at
    # least 4 s before the lease can run out, and the eval waits well past the proxy.
    assert lease - limits.decode_wait_s() >= 4
    assert client - limits.answer_wait_s() >= 60


@pytest.mark.parametrize(
    ("overrides", "said"),
    [
        ({"NIXL_KV_LEASE_S": "20"}, "the KV lease NIXL_KV_LEASE_S=20 s is not longer than"),
        ({"PROXY_DECODE_TIMEOUT_S": "300"}, "PROXY_DECODE_TIMEOUT_S=300 s + 2 x"),
        ({"PROXY_CONNECT_TIMEOUT_S": "5"}, "2 x PROXY_CONNECT_TIMEOUT_S=5 s = 30 s"),
        ({"EVAL_REQUEST_TIMEOUT_S": "300"}, "EVAL_REQUEST_TIMEOUT_S=300 s is not longer than"),
        ({"PROXY_PREFILL_TIMEOUT_S": "600"}, "PROXY_PREFILL_TIMEOUT_S=600 s"),
        ({"PROXY_DECODE_TIMEOUT_S": "0"}, "PROXY_DECODE_TIMEOUT_S must be > 0"),
        ({"EVAL_REQUEST_TIMEOUT_S": "soon"}, "EVAL_REQUEST_TIMEOUT_S='soon': expected a number"),
    ],
    ids=["short-lease", "long-decode", "long-connect", "short-client", "long-prefill", "0", "nan"],
)
def test_settings_that_disagree_are_refused(overrides: dict[str, str], said: str) -> None:
    env = {**example_env(), **overrides}
    with pytest.raises(SettingsError) as err:
        settings_from_env(env)
    assert said in str(err.value)


def test_raising_the_lease_with_the_decode_timeout_is_fine() -> None:
    env = {**example_env(), "NIXL_KV_LEASE_S": "300", "PROXY_DECODE_TIMEOUT_S": "280"}
    assert settings_from_env(env).kv_lease_s == 300


def test_the_local_proxy_gets_the_limits_and_the_lease() -> None:
    settings = example_settings(proxy_decode_timeout_s=12.5, kv_lease_s=40)
    argv = proxy_spec(settings).argv
    # Each flag with its value (switches such as --admission have none).
    pairs = zip(argv[3:-1], argv[4:], strict=True)
    flags = {a: b for a, b in pairs if a[:2] == "--" and b[:2] != "--"}
    assert flags["--decode-timeout"] == "12.5" and flags["--kv-lease-s"] == "40"
    assert flags["--connect-timeout"] == "3" and flags["--prefill-timeout"] == "300"
    # The proxy parses them and runs its own check (here: passes, and refuses a longer decode).
    config = load_config(argv[3:], {})
    assert (config.decode_timeout, config.kv_lease_s, config.connect_timeout) == (12.5, 40, 3)
    bad = proxy_spec(example_settings(proxy_decode_timeout_s=35.0, kv_lease_s=40)).argv
    with pytest.raises(ValueError, match="PD_PROXY_KV_LEASE_S=40 s"):
        load_config(bad[3:], {})
