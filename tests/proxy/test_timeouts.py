"""The KV-lease / proxy / client timeout rule (pd_proxy.timeouts) and pd-proxy's start-up check."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import pytest

from pd_proxy import cli
from pd_proxy.config import ConfigError, ProxyConfig, load_config
from pd_proxy.timeouts import (
    KIT_NAMES,
    VLLM_DEFAULT_KV_LEASE_S,
    ProxyLimits,
    timeout_problems,
)

BASE = ["--prefill", "http://p:1", "--decode", "http://d:2"]


def test_limits_default_to_the_proxy_defaults() -> None:
    config = ProxyConfig(prefill=("http://p:1",), decode=("http://d:2",))
    assert config.limits() == ProxyLimits()
    fields = {f.name: f.default for f in dataclasses.fields(ProxyConfig)}
    assert (fields["connect_timeout"], fields["prefill_timeout"], fields["decode_timeout"]) == (
        ProxyLimits.connect_s,
        ProxyLimits.prefill_s,
        ProxyLimits.decode_s,
    )


def test_vllm_default_lease_is_the_installed_vllms() -> None:
    """The lease preflight assumes when a prefill sets none, and the heartbeat arithmetic the
    docs quote, read from the installed vLLM's source (not imported: that takes seconds)."""
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.submodule_search_locations
    nixl = Path(next(iter(spec.submodule_search_locations)))
    nixl = nixl / "distributed" / "kv_transfer" / "kv_connector" / "v1" / "nixl"
    scheduler = " ".join((nixl / "base_scheduler.py").read_text().split())
    worker = " ".join((nixl / "base_worker.py").read_text().split())
    default = f'get_from_extra_config( "kv_lease_duration", {VLLM_DEFAULT_KV_LEASE_S} )'
    assert default in scheduler and default in worker
    assert "self._heartbeat_interval = self._kv_lease_duration // 6" in scheduler
    assert "self._lease_extension = kv_lease_duration * 2 // 3" in worker
    assert "VLLM_NIXL_ABORT_REQUEST_TIMEOUT" not in worker + scheduler


def test_decode_wait_and_answer_wait() -> None:
    limits = ProxyLimits(connect_s=3, prefill_s=300, decode_s=20)
    assert limits.decode_wait_s() == 26  # 20 + a connect retried once on another decode
    assert limits.answer_wait_s() == 329  # + a failed prefill connect + the prefill leg
    assert ProxyLimits(3, 300, 20, block_size_wait_s=2).decode_wait_s() == 28


def test_lease_must_be_strictly_longer_than_the_decode_wait() -> None:
    limits = ProxyLimits(connect_s=3, prefill_s=300, decode_s=20)
    assert timeout_problems(26.5, limits) == []
    (problem,) = timeout_problems(26, limits)
    assert "is not longer than" in problem and "= 26 s" in problem
    assert "Set --decode-timeout/PD_PROXY_DECODE_TIMEOUT below 20" in problem
    (problem,) = timeout_problems(5, limits)  # no decode timeout fits: shorten or raise
    assert "Shorten the proxy's limits, or raise --kv-lease-s/PD_PROXY_KV_LEASE_S above 26" in (
        problem
    )
    assert timeout_problems(None, limits) == []  # lease unknown: not judged


def test_the_message_names_both_values_and_what_goes_wrong() -> None:
    (problem,) = timeout_problems(30, ProxyLimits(decode_s=300, connect_s=5), names=KIT_NAMES)
    assert "the KV lease NIXL_KV_LEASE_S=30 s" in problem
    assert "PROXY_DECODE_TIMEOUT_S=300 s + 2 x PROXY_CONNECT_TIMEOUT_S=5 s = 310 s" in problem
    assert "HTTP 200 with wrong text" in problem
    assert "Set PROXY_DECODE_TIMEOUT_S below 20, or raise NIXL_KV_LEASE_S above 310." in problem


def test_the_block_size_wait_counts_when_there_is_one() -> None:
    limits = ProxyLimits(connect_s=3, decode_s=20, block_size_wait_s=5)
    (problem,) = timeout_problems(30, limits)
    assert "+ --health-timeout/PD_PROXY_HEALTH_TIMEOUT=5 s = 31 s" in problem
    assert "health" not in timeout_problems(20, ProxyLimits(connect_s=3, decode_s=20))[0]


def test_client_must_wait_longer_than_the_proxy() -> None:
    limits = ProxyLimits(connect_s=3, prefill_s=300, decode_s=20)
    assert timeout_problems(30, limits, client_s=330) == []
    (problem,) = timeout_problems(30, limits, client_s=329, names=KIT_NAMES)
    assert problem.startswith("EVAL_REQUEST_TIMEOUT_S=329 s is not longer than")
    assert "PROXY_PREFILL_TIMEOUT_S=300 s" in problem and "= 329 s" in problem
    assert "Raise EVAL_REQUEST_TIMEOUT_S above 329" in problem
    assert len(timeout_problems(10, limits, client_s=10)) == 2  # both rules, lease first
    assert timeout_problems(None, limits, client_s=400) == []


# ----------------------------------------------------------------------------- pd-proxy
def test_proxy_refuses_a_lease_its_decode_wait_could_outlast() -> None:
    with pytest.raises(ConfigError) as err:
        load_config([*BASE, "--kv-lease-s", "30"], {})  # the defaults: 300 s + 2 x 5 s
    message = str(err.value)
    assert "--kv-lease-s/PD_PROXY_KV_LEASE_S=30 s" in message
    assert "--decode-timeout/PD_PROXY_DECODE_TIMEOUT=300 s" in message
    with pytest.raises(ConfigError, match="PD_PROXY_KV_LEASE_S=30 s"):
        load_config(BASE, {"PD_PROXY_KV_LEASE_S": "30"})
    with pytest.raises(ConfigError, match="kv_lease_s must be > 0"):
        load_config([*BASE, "--kv-lease-s", "0"], {})


def test_proxy_accepts_limits_inside_the_lease() -> None:
    env = {"PD_PROXY_KV_LEASE_S": "30", "PD_PROXY_DECODE_TIMEOUT": "20"}
    config = load_config([*BASE, "--connect-timeout", "3"], env)
    assert config.kv_lease_s == 30.0
    assert load_config(BASE, {}).kv_lease_s is None  # not given: not checked


def test_first_token_mode_adds_the_block_size_wait() -> None:
    flags = [*BASE, "--kv-lease-s", "30", "--decode-timeout", "20", "--connect-timeout", "3"]
    assert load_config([*flags, "--first-token-from-prefill"], {}).limits().block_size_wait_s == 2
    with pytest.raises(ConfigError, match="PD_PROXY_HEALTH_TIMEOUT=5 s = 31 s"):
        load_config([*flags, "--first-token-from-prefill", "--health-timeout", "5"], {})
    assert load_config([*flags, "--health-timeout", "5"], {}).limits().block_size_wait_s == 0


def test_cli_exits_2_naming_both_values(capsys, monkeypatch) -> None:
    monkeypatch.delenv("PD_PROXY_DECODE_TIMEOUT", raising=False)
    assert cli.main([*BASE, "--kv-lease-s", "30"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pd-proxy: error: the KV lease --kv-lease-s/PD_PROXY_KV_LEASE_S=30 s")
    assert "--decode-timeout/PD_PROXY_DECODE_TIMEOUT=300 s" in err
