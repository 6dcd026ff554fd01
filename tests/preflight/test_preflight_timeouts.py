"""The `timeouts` check: the kv_producer's KV lease against each pd-proxy service's limits, read
from the resolved services' environments (fake Compose answers, then the repo's compose.yaml
through the real Compose binary where it is installed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pd_proxy.config import ProxyConfig
from tests.preflight.fake_host import (
    GPU_UCX_ENV,
    REAL_COMPOSE,
    REPO,
    FakeHost,
    consistent,
    python_for,
)

KIT_PROXY_ENV = {
    "PD_PROXY_PREFILL": "http://prefill:8100",
    "PD_PROXY_DECODE": "http://decode:8200",
    "PD_PROXY_CONNECT_TIMEOUT": "3",
    "PD_PROXY_PREFILL_TIMEOUT": "300",
    "PD_PROXY_DECODE_TIMEOUT": "20",
    "PD_PROXY_KV_LEASE_S": "30",
}


def stack(host: FakeHost, proxy: dict[str, str] | None = None, lease: str | None = None) -> None:
    """The fake host's services as the kit's compose.yaml has them: roles, a proxy."""
    host.services["prefill"]["environment"] = {**GPU_UCX_ENV, "KIT_KV_ROLE": "kv_producer"}
    host.services["decode"]["environment"] = {**GPU_UCX_ENV, "KIT_KV_ROLE": "kv_consumer"}
    if lease is not None:
        for name in ("prefill", "decode"):
            host.services[name]["environment"]["KIT_NIXL_KV_LEASE_S"] = lease
    host.services["proxy"] = {
        "image": "pd-proxy",
        "environment": {**KIT_PROXY_ENV, **(proxy or {})},
    }


def test_kit_defaults_pass(host: FakeHost) -> None:
    stack(host)
    out = consistent(host.run())
    assert out.returncode == 0, out.dump()
    assert out.status("timeouts") == ["ok"]
    text = out.text("timeouts")
    assert "the KV lease on prefill (30 s)" in text and "(26 s: decode timeout 20 s" in text


def test_no_proxy_service_means_no_line(host: FakeHost) -> None:
    assert consistent(host.run()).status("timeouts") == []


@pytest.mark.parametrize(
    ("proxy", "lease", "said"),
    [
        ({"PD_PROXY_DECODE_TIMEOUT": "300", "PD_PROXY_KV_LEASE_S": ""}, None,
         "the KV lease NIXL_KV_LEASE_S=30 s is not longer than"),
        ({"PD_PROXY_DECODE_TIMEOUT": None}, None, "PROXY_DECODE_TIMEOUT_S=300 s + 2 x"),
        ({"PD_PROXY_KV_LEASE_S": "20"}, "20", "NIXL_KV_LEASE_S=20 s is not longer than"),
        ({"PD_PROXY_CONNECT_TIMEOUT": "6"}, None, "2 x PROXY_CONNECT_TIMEOUT_S=6 s = 32 s"),
        ({"PD_PROXY_FIRST_TOKEN_FROM_PREFILL": "true", "PD_PROXY_HEALTH_TIMEOUT": "5"}, None,
         "+ PD_PROXY_HEALTH_TIMEOUT=5 s = 31 s"),
    ],
    ids=["long-decode", "proxy-default-decode", "short-lease", "long-connect", "first-token"],
)  # fmt: skip
def test_a_decode_wait_the_lease_does_not_cover_fails(
    host: FakeHost, proxy: dict[str, str | None], lease: str | None, said: str
) -> None:
    stack(host, lease=lease)
    env = host.services["proxy"]["environment"]
    for key, value in proxy.items():
        if value is None:
            env.pop(key)
        else:
            env[key] = value
    out = consistent(host.run())
    assert out.status("timeouts") == ["FAIL"] and out.returncode == 1, out.dump()
    text = out.text("timeouts")
    assert said in text
    assert text.startswith("proxy in front of prefill (.env): the KV lease")
    assert "HTTP 200 with wrong text" in text


def test_the_proxy_must_be_told_the_lease_prefill_keeps(host: FakeHost) -> None:
    """NIXL_KV_LEASE_S raised for the proxy but not reaching the prefill: the proxy's own check
    would pass against a lease the prefill does not keep, so that is the FAIL, named first."""
    stack(host, proxy={"PD_PROXY_KV_LEASE_S": "60"}, lease="30")
    out = consistent(host.run())
    assert out.status("timeouts") == ["FAIL"]
    text = out.text("timeouts")
    assert "a KV lease of 60 s (PD_PROXY_KV_LEASE_S), but prefill keeps KV for 30 s" in text
    assert "(KIT_NIXL_KV_LEASE_S): both must get the lease NIXL_KV_LEASE_S sets in .env." in text
    stack(host, proxy={"PD_PROXY_KV_LEASE_S": "60", "PD_PROXY_DECODE_TIMEOUT": "40"})
    out = consistent(host.run())  # no KIT_NIXL_KV_LEASE_S on prefill: vLLM's 30 s
    assert out.status("timeouts") == ["FAIL"]
    assert (
        "but prefill keeps KV for 30 s (vLLM's default; compose passes it no KIT_NIXL_KV_LEASE_S)"
        in out.text("timeouts")
    )


def test_a_value_that_is_not_seconds_fails(host: FakeHost) -> None:
    stack(host, proxy={"PD_PROXY_DECODE_TIMEOUT": "soon"})
    out = consistent(host.run())
    assert out.status("timeouts") == ["FAIL"]
    assert "service proxy has PD_PROXY_DECODE_TIMEOUT='soon'" in out.text("timeouts")
    assert "set PROXY_DECODE_TIMEOUT_S in .env." in out.text("timeouts")


def test_health_timeout_default_is_the_proxys() -> None:
    from pcp_pd_kit.preflight.check_timeouts import PROXY_HEALTH_TIMEOUT_S

    assert ProxyConfig(prefill=("http://p:1",), decode=("http://d:2",)).health_timeout == (
        PROXY_HEALTH_TIMEOUT_S
    )


# ----------------------------------------------------------------------------- the repo's files
REPO_COMPOSE = REPO / "compose.yaml"
needs_compose = pytest.mark.skipif(
    not REAL_COMPOSE.is_file() or not REPO_COMPOSE.is_file(),
    reason=f"no Docker Compose plugin at {REAL_COMPOSE}",
)


def run_repo_compose(host: FakeHost, overrides: dict[str, str], *args: str):
    """Preflight on the repo's compose.yaml with .env.example plus ``overrides`` as the env file."""
    host.compose_real = REAL_COMPOSE
    env_file = host.tmp / "site.env"
    env_file.write_text(
        (REPO / ".env.example").read_text() + "".join(f"{k}={v}\n" for k, v in overrides.items())
    )
    ports = {k.upper(): host.settings[k] for k in ("proxy_port", "prometheus_port", "grafana_port")}
    return consistent(
        host.run(
            "--env-file", str(env_file), *args, PREFLIGHT_COMPOSE_FILE=None,
            HF_CACHE_DIR=str(host.cache), **ports,
        )
    )  # fmt: skip


@needs_compose
@pytest.mark.parametrize("profile", [(), ("--profile", "cpu")], ids=["gpu", "cpu"])
def test_repo_compose_with_env_example_passes(host: FakeHost, profile: tuple[str, ...]) -> None:
    out = run_repo_compose(host, {}, *profile)
    assert out.status("timeouts") == ["ok"], out.dump()
    assert "(30 s) outlasts" in out.text("timeouts") and "(26 s:" in out.text("timeouts")


@needs_compose
def test_repo_compose_refuses_a_long_decode_timeout(host: FakeHost) -> None:
    out = run_repo_compose(host, {"PROXY_DECODE_TIMEOUT_S": "60"}, "--profile", "cpu")
    assert out.status("timeouts") == ["FAIL"], out.dump()
    assert "NIXL_KV_LEASE_S=30 s" in out.text("timeouts")
    assert "PROXY_DECODE_TIMEOUT_S=60 s" in out.text("timeouts")
    # A longer lease fixes it where compose hands the lease to the prefill
    # (KIT_NIXL_KV_LEASE_S); where it does not, the prefill keeps vLLM's 30 s and preflight
    # says so.
    raised = {"PROXY_DECODE_TIMEOUT_S": "60", "NIXL_KV_LEASE_S": "90"}
    for profile in ((), ("--profile", "cpu")):
        out = run_repo_compose(host, raised, *profile)
        services = repo_services(raised, profile)
        prefill = next(p for p in ("prefill-cpu", "prefill") if p in services)
        gets_lease = "KIT_NIXL_KV_LEASE_S" in services[prefill]["environment"]
        if gets_lease:
            assert out.status("timeouts") == ["ok"], out.dump()
        else:
            assert out.status("timeouts") == ["FAIL"], out.dump()
            assert (
                "keeps KV for 30 s (vLLM's default; compose passes it no KIT_NIXL_KV_LEASE_S)"
                in (out.text("timeouts"))
            )


def repo_services(overrides: dict[str, str], profile: tuple[str, ...]) -> dict:
    """The repo's compose.yaml resolved by the real Compose with .env.example + ``overrides``."""
    import json
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        env_file = Path(tmp) / "site.env"
        env_file.write_text(
            (REPO / ".env.example").read_text()
            + "".join(f"{k}={v}\n" for k, v in overrides.items())
        )
        argv = [str(REAL_COMPOSE), "--env-file", str(env_file), *profile]
        argv += ["-f", str(REPO_COMPOSE), "config", "--format", "json"]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)["services"]


def test_path_of_the_rule_is_the_proxys() -> None:
    """Preflight imports the very module pd-proxy enforces (no copy to drift)."""
    import pd_proxy.timeouts
    from pcp_pd_kit.preflight import check_timeouts

    assert check_timeouts.timeout_problems is pd_proxy.timeouts.timeout_problems
    assert Path(pd_proxy.timeouts.__file__).resolve() == REPO / "proxy/pd_proxy/timeouts.py"


def test_the_rule_runs_on_the_oldest_python(host: FakeHost) -> None:
    python = python_for("3.8")
    if python is None:
        pytest.skip("no Python 3.8 interpreter here (python3.8 or pyenv 3.8.x)")
    stack(host, proxy={"PD_PROXY_DECODE_TIMEOUT": "300"})
    out = consistent(host.run(python=python))
    assert out.status("timeouts") == ["FAIL"], out.dump()
    assert "PROXY_DECODE_TIMEOUT_S=300 s" in out.text("timeouts")
