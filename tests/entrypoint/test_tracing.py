"""The entrypoint's tracing: with KIT_OTEL_EXPORTER_OTLP_TRACES_ENDPOINT set, vLLM gets
--otlp-traces-endpoint, the protocol and a service name naming its role and replica (compose's
index, a pod's name); empty, nothing at all. The flag and the exporter are checked against the
installed vLLM's own parser and exporter choice."""

from __future__ import annotations

import pytest
from vllm_serve import command, environment, tracing

BASE = {
    "KIT_KV_CONNECTOR": "PcpCanonicalNixlConnector",
    "KIT_KV_CONNECTOR_MODULE_PATH": "pcp_nixl_connector",
    "VLLM_NIXL_SIDE_CHANNEL_HOST": "10.0.0.7",
}
PREFILL = {**BASE, "KIT_KV_ROLE": "kv_producer"}
DECODE = {**BASE, "KIT_KV_ROLE": "kv_consumer"}
ENDPOINT = "http://collector:4317"
ON = {tracing.ENDPOINT_ENV: ENDPOINT}


def serve_env(env: dict[str, str], index: int = 1) -> dict[str, str]:
    return environment.serve_environment(env, address=lambda: "x", lookup=lambda: index)


def test_off_by_default_adds_nothing() -> None:
    for env in (DECODE, {**DECODE, tracing.ENDPOINT_ENV: " ", tracing.PROTOCOL_ENV: "grpc"}):
        assert "--otlp-traces-endpoint" not in command.vllm_command(["--model", "m"], env, "py")
        assert serve_env(env) == env


def test_on_gives_the_flag_the_protocol_and_a_name_per_role_and_replica() -> None:
    cmd = command.vllm_command(["--model", "m"], {**DECODE, **ON}, "py")
    assert cmd[cmd.index("--otlp-traces-endpoint") + 1] == ENDPOINT
    assert cmd[-2] == "--kv-transfer-config"  # still last: the start-up line prints cmd[-1]
    names = {
        serve_env({**PREFILL, **ON, "KIT_ROLE_REPLICAS": "2"}, 2)["OTEL_SERVICE_NAME"],
        serve_env({**DECODE, **ON})["OTEL_SERVICE_NAME"],
        serve_env({**DECODE, **ON, "KIT_ROLE_REPLICAS": "3"}, 3)["OTEL_SERVICE_NAME"],
    }
    assert names == {"vllm-prefill-2", "vllm-decode-1", "vllm-decode-3"}
    out = serve_env({**PREFILL, **ON, tracing.PROTOCOL_ENV: "http/protobuf"})
    assert out["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] == "http/protobuf"
    assert serve_env({**PREFILL, **ON})["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] == "grpc"


def test_a_pod_is_named_by_its_own_name_and_an_explicit_name_wins() -> None:
    pod = {**PREFILL, **ON, tracing.POD_NAME_ENV: "pcp-pd-prefill-7d9f8c5b4-x7k2p"}
    out = serve_env({**pod, "OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=prod"})
    assert out["OTEL_SERVICE_NAME"] == "vllm-prefill-x7k2p"
    assert out["OTEL_RESOURCE_ATTRIBUTES"] == (
        "deployment.environment=prod,k8s.pod.name=pcp-pd-prefill-7d9f8c5b4-x7k2p"
    )
    assert serve_env({**pod, "OTEL_SERVICE_NAME": "mine"})["OTEL_SERVICE_NAME"] == "mine"
    # An index that could not be looked up: the container's host name instead.
    assert tracing.service_name(DECODE, 0, "3f2a9c1b7d4e") == "vllm-decode-3f2a9c1b7d4e"


def test_a_protocol_vllm_cannot_export_with_is_refused() -> None:
    env = {**DECODE, **ON, tracing.PROTOCOL_ENV: "http/json"}
    with pytest.raises(ValueError, match="want one of grpc, http/protobuf"):
        serve_env(env)


@pytest.mark.parametrize("argv", [["--otlp-traces-endpoint", "x"], ["--otlp_traces_endpoint=x"]])
def test_the_flag_in_the_arguments_is_refused(argv: list[str]) -> None:
    """In VLLM_EXTRA_ARGS it would come without the service name (and fight the knob's)."""
    for env in (DECODE, {**DECODE, **ON}):
        with pytest.raises(ValueError, match="VLLM_EXTRA_ARGS"):
            command.vllm_command(argv, env, "py")


def test_vllm_reads_the_flag_and_exports_with_the_protocol(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.tracing import otel
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    cmd = command.vllm_command(["--model", "m"], {**DECODE, **ON}, "py")
    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(cmd[3:])
    assert args.otlp_traces_endpoint == ENDPOINT
    out = serve_env({**DECODE, **ON, tracing.PROTOCOL_ENV: "http/protobuf"})
    protocol = out["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"]
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", protocol)
    exporter = otel.get_span_exporter("http://collector:4318/v1/traces")
    assert type(exporter).__module__.endswith("proto.http.trace_exporter")
