"""Request tracing for vLLM (OpenTelemetry): its flag and its environment, from the kit's knobs.

vLLM 0.32 traces requests only when started with ``--otlp-traces-endpoint``; it then exports one
``llm_request`` span per request under the request's ``traceparent`` (pd-proxy's leg span), with
the protocol OTEL_EXPORTER_OTLP_TRACES_PROTOCOL names (``grpc``, its default, or
``http/protobuf``) and the resource OTEL_SERVICE_NAME / OTEL_RESOURCE_ATTRIBUTES give.

Compose (x-vllm-env) and the Kubernetes pods (pcp-pd-params, envFrom prefix KIT_) hand the
entrypoint the .env knobs OTEL_EXPORTER_OTLP_TRACES_ENDPOINT and OTEL_EXPORTER_OTLP_TRACES_PROTOCOL
as KIT_OTEL_EXPORTER_OTLP_TRACES_ENDPOINT / KIT_OTEL_EXPORTER_OTLP_TRACES_PROTOCOL. Empty endpoint:
no tracing, nothing added. Set: the flag, the protocol, and a service name of this server's own,
``vllm-<prefill|decode>-<replica>`` (compose's replica index; on Kubernetes the suffix of the
pod's name, KIT_POD_NAME), so one trace shows which replica did what. An OTEL_SERVICE_NAME already
in the environment wins.
Standard library only, Python 3.8 syntax.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

TRACES_FLAG = "--otlp-traces-endpoint"
ENDPOINT_ENV = "KIT_OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"  # .env OTEL_EXPORTER_OTLP_TRACES_ENDPOINT
PROTOCOL_ENV = "KIT_OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"  # .env OTEL_EXPORTER_OTLP_TRACES_PROTOCOL
# Kubernetes: the pod's name (downward API), the replica's identity there.
POD_NAME_ENV = "KIT_POD_NAME"
PROTOCOLS = ("grpc", "http/protobuf")  # what vLLM's exporter takes (vllm/tracing/otel.py)
DEFAULT_PROTOCOL = "grpc"
ROLE_NAMES = {"kv_producer": "prefill", "kv_consumer": "decode"}


def traces_endpoint(env: Mapping[str, str]) -> str:
    """The OTLP endpoint this server exports spans to; empty: tracing off."""
    return env.get(ENDPOINT_ENV, "").strip()


def tracing_flags(env: Mapping[str, str], argv: Sequence[str]) -> list[str]:
    """``--otlp-traces-endpoint URL`` when the endpoint is set; ValueError when ``argv`` gives
    the flag itself (the service name and protocol would be missing, or fight the knob's)."""
    if any(a.split("=", 1)[0].replace("_", "-") == TRACES_FLAG for a in argv):
        raise ValueError(
            f"{TRACES_FLAG} is in the arguments (VLLM_EXTRA_ARGS?): the entrypoint adds it from "
            f"{ENDPOINT_ENV}; set OTEL_EXPORTER_OTLP_TRACES_ENDPOINT in .env instead"
        )
    endpoint = traces_endpoint(env)
    return [TRACES_FLAG, endpoint] if endpoint else []


def service_name(env: Mapping[str, str], replica: int, host: str = "") -> str:
    """``vllm-<role>-<replica>``: the role from KIT_KV_ROLE, the replica a pod's name suffix
    (KIT_POD_NAME: a Deployment's random suffix, a LeaderWorkerSet group's index), else compose's
    index, else (not known) ``host``."""
    role = ROLE_NAMES.get(env.get("KIT_KV_ROLE", "").strip(), "server")
    pod = env.get(POD_NAME_ENV, "").strip()
    which = pod.rsplit("-", 1)[-1] if pod else str(replica) if replica > 0 else host
    return f"vllm-{role}-{which}" if which else f"vllm-{role}"


def tracing_environment(env: Mapping[str, str], replica: int, host: str = "") -> dict[str, str]:
    """What vLLM's environment needs for tracing: the protocol, the service name (unless
    OTEL_SERVICE_NAME is set already) and, on Kubernetes, the pod's name as a resource attribute.
    Nothing when the endpoint is empty; ValueError for a protocol vLLM cannot export with."""
    if not traces_endpoint(env):
        return {}
    protocol = env.get(PROTOCOL_ENV, "").strip() or DEFAULT_PROTOCOL
    if protocol not in PROTOCOLS:
        raise ValueError(
            f"{PROTOCOL_ENV}={protocol!r} (OTEL_EXPORTER_OTLP_TRACES_PROTOCOL): want one of "
            f"{', '.join(PROTOCOLS)}"
        )
    out = {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": protocol}
    if not env.get("OTEL_SERVICE_NAME", "").strip():
        out["OTEL_SERVICE_NAME"] = service_name(env, replica, host)
    pod = env.get(POD_NAME_ENV, "").strip()
    if pod:
        attributes = env.get("OTEL_RESOURCE_ATTRIBUTES", "").strip()
        pod_attribute = f"k8s.pod.name={pod}"
        out["OTEL_RESOURCE_ATTRIBUTES"] = (
            f"{attributes},{pod_attribute}" if attributes else pod_attribute
        )
    return out
