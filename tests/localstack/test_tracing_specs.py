"""The local stack's tracing: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT set gives each vLLM server
--otlp-traces-endpoint, the protocol and a service name of its own, and pd-proxy the same
endpoint and protocol; empty (.env.example's default) gives nothing at all."""

from __future__ import annotations

from pathlib import Path

import pytest

from pcp_pd_kit.localstack.commands import proxy_spec, vllm_server_spec
from pcp_pd_kit.settings import SettingsError, settings_from_env
from tests.support.env import example_env, example_settings

REPO = Path("/repo")
ENDPOINT = "http://127.0.0.1:4318/v1/traces"
OTEL = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")


def test_off_by_default() -> None:
    settings = example_settings()
    assert settings.otlp_traces_endpoint == ""
    assert settings.otlp_traces_protocol == "grpc"
    for role in ("prefill", "decode", "reference"):
        spec = vllm_server_spec(settings, role, "/m", "t", REPO)  # type: ignore[arg-type]
        assert "--otlp-traces-endpoint" not in spec.argv
        assert not [k for k in spec.env if k.startswith("OTEL_")]
    assert proxy_spec(settings).env == {}


def test_on_reaches_every_server_and_the_proxy_each_named() -> None:
    env = {**example_env(), OTEL[0]: ENDPOINT, OTEL[1]: "http/protobuf"}
    settings = settings_from_env(env)
    names = {}
    for role in ("prefill", "decode", "reference"):
        spec = vllm_server_spec(settings, role, "/m", "t", REPO)  # type: ignore[arg-type]
        assert spec.argv[spec.argv.index("--otlp-traces-endpoint") + 1] == ENDPOINT
        assert (spec.env[OTEL[0]], spec.env[OTEL[1]]) == (ENDPOINT, "http/protobuf")
        names[role] = spec.env["OTEL_SERVICE_NAME"]
    assert names == {
        "prefill": "vllm-prefill-1",
        "decode": "vllm-decode-1",
        "reference": "vllm-reference",
    }
    for spec in (proxy_spec(settings), proxy_spec(settings, first_token_port=18999)):
        assert spec.env == {
            OTEL[0]: ENDPOINT,
            OTEL[1]: "http/protobuf",
            "OTEL_SERVICE_NAME": "pd-proxy",
        }


def test_a_protocol_nothing_exports_with_is_refused() -> None:
    with pytest.raises(SettingsError, match="OTEL_EXPORTER_OTLP_TRACES_PROTOCOL='http/json'"):
        settings_from_env({**example_env(), OTEL[1]: "http/json"})
