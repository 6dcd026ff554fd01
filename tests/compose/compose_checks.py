"""Semantic checks on an interpolated compose model. Each returns a list of problems (empty = ok),
so the tests can show a check passes on the real files *and* fails on a broken copy."""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Any

Compose = Mapping[str, Any]


def command_args(service: Mapping[str, Any]) -> list[str]:
    """The service's command as argv (Compose splits a string command like a shell does)."""
    command = service.get("command", [])
    return shlex.split(command) if isinstance(command, str) else [str(a) for a in command]


def flag_value(args: list[str], flag: str) -> str | None:
    """Value of ``--flag V`` or ``--flag=V``; None when absent."""
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def kv_config(service: Mapping[str, Any]) -> dict[str, Any] | None:
    raw = flag_value(command_args(service), "--kv-transfer-config")
    return json.loads(raw) if raw else None


def environment(service: Mapping[str, Any]) -> dict[str, str]:
    env = service.get("environment", {})
    if isinstance(env, list):
        return dict(item.split("=", 1) if "=" in item else (item, "") for item in env)
    return {k: "" if v is None else str(v) for k, v in env.items()}


def gpu_ids(service: Mapping[str, Any]) -> list[str]:
    devices = (
        service.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
    )
    ids: list[str] = []
    for device in devices:
        if "gpu" in device.get("capabilities", []):
            ids.extend(str(i) for i in device.get("device_ids", []))
    return ids


def vllm_services(compose: Compose) -> dict[str, Mapping[str, Any]]:
    return {n: s for n, s in compose["services"].items() if kv_config(s) is not None}


def check_kv_roles(compose: Compose, env: Mapping[str, str]) -> list[str]:
    """Prefill services produce, decode services consume, all through the kit's connector."""
    problems = []
    for name, service in vllm_services(compose).items():
        cfg = kv_config(service) or {}
        want = "kv_producer" if name.startswith("prefill") else "kv_consumer"
        if cfg.get("kv_role") != want:
            problems.append(f"{name}: kv_role {cfg.get('kv_role')!r}, want {want!r}")
        if cfg.get("kv_connector") != env["KV_CONNECTOR"]:
            problems.append(f"{name}: kv_connector {cfg.get('kv_connector')!r}")
        if cfg.get("kv_connector_module_path") != env["KV_CONNECTOR_MODULE_PATH"]:
            module = cfg.get("kv_connector_module_path")
            problems.append(f"{name}: kv_connector_module_path {module!r}")
    roles = {(kv_config(s) or {}).get("kv_role") for s in vllm_services(compose).values()}
    if not {"kv_producer", "kv_consumer"} <= roles:
        problems.append(f"both kv roles needed, found {sorted(r for r in roles if r)}")
    return problems


def check_gpu_prefill(compose: Compose, env: Mapping[str, str]) -> list[str]:
    """GPU prefill: PCP/TP/EP flags from .env and exactly TP x PCP reserved GPUs; decode its own."""
    services = compose["services"]
    prefill, decode = services["prefill"], services["decode"]
    args = command_args(prefill)
    problems = []
    pcp, tp = env["PREFILLER_PCP_SIZE"], env["PREFILLER_TP_SIZE"]
    if flag_value(args, "--prefill-context-parallel-size") != pcp:
        problems.append("prefill: --prefill-context-parallel-size != PREFILLER_PCP_SIZE")
    if flag_value(args, "--tensor-parallel-size") != tp:
        problems.append("prefill: --tensor-parallel-size != PREFILLER_TP_SIZE")
    if "--enable-expert-parallel" not in args:
        problems.append("prefill: --enable-expert-parallel missing")
    if flag_value(command_args(decode), "--tensor-parallel-size") != env["DECODER_TP_SIZE"]:
        problems.append("decode: --tensor-parallel-size != DECODER_TP_SIZE")
    p_ids, d_ids = gpu_ids(prefill), gpu_ids(decode)
    if len(p_ids) != int(tp) * int(pcp):
        problems.append(f"prefill reserves {len(p_ids)} GPUs, TP x PCP = {int(tp) * int(pcp)}")
    if len(d_ids) != int(env["DECODER_TP_SIZE"]):
        want = env["DECODER_TP_SIZE"]
        problems.append(f"decode reserves {len(d_ids)} GPUs, DECODER_TP_SIZE = {want}")
    if len(set(p_ids + d_ids)) != len(p_ids) + len(d_ids):
        problems.append(f"GPU ids overlap or repeat: prefill {p_ids}, decode {d_ids}")
    return problems


def check_connector_mount(compose: Compose, compose_dir: Path, module_path: str) -> list[str]:
    """The connector is mounted read-only at a PYTHONPATH entry that holds ``module_path``."""
    problems = []
    rel = Path(*module_path.split("."))
    for name, service in vllm_services(compose).items():
        pythonpath = environment(service).get("PYTHONPATH", "").split(":")
        mounts = [v for v in service.get("volumes", []) if isinstance(v, str)]
        hits = []
        for mount in mounts:
            parts = mount.split(":")
            if len(parts) < 2 or parts[1] not in pythonpath:
                continue
            source = (compose_dir / parts[0]).resolve()
            if not ((source / rel).is_dir() or (source / rel).with_suffix(".py").is_file()):
                problems.append(f"{name}: {source} has no module {module_path}")
            if len(parts) < 3 or "ro" not in parts[2].split(","):
                problems.append(f"{name}: connector mount {mount!r} is not read-only")
            hits.append(mount)
        if not hits:
            problems.append(f"{name}: no volume mounted at a PYTHONPATH entry {pythonpath}")
    return problems


def check_pd_runtime(compose: Compose) -> list[str]:
    """What two P/D containers on one host need for CUDA IPC, NIXL handshakes and health."""
    problems = []
    ports: dict[str, str] = {}
    for name, service in vllm_services(compose).items():
        env = environment(service)
        if service.get("ipc") != "host":
            problems.append(f"{name}: ipc must be host")
        if service.get("pid") != "host" and not str(service.get("pid", "")).startswith("service:"):
            problems.append(f"{name}: needs a shared PID namespace")
        if not service.get("shm_size"):
            problems.append(f"{name}: shm_size missing")
        memlock = service.get("ulimits", {}).get("memlock", {})
        if memlock != {"soft": -1, "hard": -1} and memlock != -1:
            problems.append(f"{name}: memlock ulimit must be unlimited")
        if not env.get("UCX_TLS"):
            problems.append(f"{name}: UCX_TLS missing")
        host = env.get("VLLM_NIXL_SIDE_CHANNEL_HOST")
        addresses = {
            str((cfg or {}).get("ipv4_address"))
            for cfg in (service.get("networks") or {}).values()
            if isinstance(service.get("networks"), dict)
        }
        if not host or host not in addresses:
            problems.append(f"{name}: side-channel host {host!r} is not its address {addresses}")
        port = env.get("VLLM_NIXL_SIDE_CHANNEL_PORT", "")
        profile = tuple(service.get("profiles", []))
        key = f"{profile}:{port}"
        if not port or key in ports:
            problems.append(f"{name}: side-channel port {port!r} missing or shared")
        ports[key] = name
        own_port = flag_value(command_args(service), "--port")
        test = " ".join(service.get("healthcheck", {}).get("test", []))
        if f":{own_port}/health" not in test:
            problems.append(f"{name}: healthcheck does not probe /health on port {own_port}")
        volumes = [str(v) for v in service.get("volumes", [])]
        if not any(v.endswith(":/root/.cache/huggingface") for v in volumes):
            problems.append(f"{name}: HF cache volume missing")
        if "HF_TOKEN" not in env:
            problems.append(f"{name}: HF_TOKEN not passed")
        if not service.get("restart"):
            problems.append(f"{name}: no restart policy")
    for name, service in compose["services"].items():
        if name.startswith("proxy"):
            deps = service.get("depends_on", {})
            servers = [d for d in deps if d.startswith(("prefill", "decode"))]
            if len(servers) != 2 or any(
                deps[d].get("condition") != "service_healthy" for d in servers
            ):
                problems.append(f"{name}: must wait for prefill and decode to be healthy")
    return problems


def service_endpoints(compose: Compose) -> dict[str, set[int]]:
    """Service name or network alias -> container ports it listens on."""
    out: dict[str, set[int]] = {}
    for name, service in compose["services"].items():
        port_values = set()
        own = flag_value(command_args(service), "--port")
        own = own or environment(service).get("PD_PROXY_PORT")
        if own:
            port_values.add(int(own))
        for mapping in service.get("ports", []):
            port_values.add(int(str(mapping).rsplit(":", 1)[-1].split("/")[0]))
        names = {name}
        networks = service.get("networks") or {}
        if isinstance(networks, dict):
            for cfg in networks.values():
                names.update((cfg or {}).get("aliases", []))
        for n in names:
            out.setdefault(n, set()).update(port_values)
    return out


def check_prometheus_targets(compose: Compose, prom: Mapping[str, Any]) -> list[str]:
    """Every scrape target is a compose service/alias on a port it serves; prefill, decode, proxy
    are all scraped."""
    endpoints = service_endpoints(compose)
    problems, jobs = [], set()
    for job in prom.get("scrape_configs", []):
        for static in job.get("static_configs", []):
            for target in static.get("targets", []):
                host, _, port = target.rpartition(":")
                if int(port) not in endpoints.get(host, set()):
                    problems.append(f"job {job['job_name']}: {target} is no compose service port")
                else:
                    jobs.add(host)
    missing = {"prefill", "decode", "proxy"} - jobs
    if missing:
        problems.append(f"not scraped: {sorted(missing)}")
    return problems
