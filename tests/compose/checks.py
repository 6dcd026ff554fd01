"""Semantic checks on the model `docker compose config --format json` renders. Each returns a list
of problems (empty = ok), so a test can show a check passing on the real file *and* failing on a
broken copy or a bad override. ``settings`` is the env file the model was rendered with."""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pcp_nixl_connector.cpu_compat.binding import parse_cpu_list
from pcp_pd_kit.preflight.settings import ENV_NAMES, OPTIONAL_ENV_NAMES, REQUIRED
from tests.entrypoint.loader import cpu_topology, effective_argv, runs_entrypoint

Compose = Mapping[str, Any]
Service = Mapping[str, Any]

LOOPBACK = "127.0.0.1"
NO_NEW_PRIVILEGES = "no-new-privileges:true"
# Environment names that would put a secret into `docker inspect` (secrets are files instead).
SECRET_ENV = {
    "GF_SECURITY_ADMIN_PASSWORD",
    "HF_TOKEN",
    "HUGGING_FACE_HUB_TOKEN",
    "VLLM_API_KEY",
    "PD_PROXY_API_KEY",
}
_SECRET_LIKE = re.compile(r"(PASSWORD|TOKEN|API_KEY|SECRET)$")
_GPU_ID = re.compile(r"^(\d+|(GPU|MIG)-[0-9A-Za-z-]+)$")
_SIZE = re.compile(r"^(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?$", re.IGNORECASE)


# ---------------------------------------------------------------------------------------- reading
def command_args(service: Service) -> list[str]:
    """The service's command as argv (rendered as a list; a string is split like a shell)."""
    command = service.get("command") or []
    return shlex.split(command) if isinstance(command, str) else [str(a) for a in command]


def flag_value(args: list[str], flag: str) -> str | None:
    """Value of ``--flag V`` or ``--flag=V``; None when absent."""
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def environment(service: Service) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        return dict(item.split("=", 1) if "=" in item else (item, "") for item in env)
    return {k: "" if v is None else str(v) for k, v in env.items()}


def seconds(duration: str) -> float:
    """A Compose duration as `config` renders it (1m30s, 80s, 1h) in seconds."""
    total, number = 0.0, ""
    units = {"h": 3600.0, "m": 60.0, "s": 1.0}
    for char in duration:
        if char.isdigit() or char == ".":
            number += char
        elif char in units and number:
            total, number = total + float(number) * units[char], ""
        else:
            raise ValueError(f"duration {duration!r}")
    if number:
        raise ValueError(f"duration {duration!r} has no unit")
    return total


def container_argv(service: Service) -> list[str]:
    """entrypoint + command, as the container starts."""
    return [*(str(a) for a in service.get("entrypoint") or []), *command_args(service)]


def is_vllm(service: Service) -> bool:
    """Whether the service runs the kit's vLLM entrypoint (compose/entrypoint/vllm_serve)."""
    return runs_entrypoint(container_argv(service))


def exec_argv(service: Service) -> list[str]:
    """The argv the container finally execs: for a vLLM service, the command the kit's entrypoint
    builds from the service's command and environment (its own pure function, --kv-transfer-config
    included). ValueError, with the entrypoint's one-line reason, where it would refuse to start."""
    return effective_argv(container_argv(service), environment(service))


def kv_config(service: Service) -> dict[str, Any] | None:
    """The --kv-transfer-config the container runs with; None for a service that is no vLLM
    server, {"invalid": reason} when the entrypoint would refuse to start or the flag is missing
    or no JSON object."""
    if not is_vllm(service):
        return None
    try:
        raw = flag_value(exec_argv(service), "--kv-transfer-config")
    except ValueError as exc:
        return {"invalid": f"the entrypoint refuses to start: {exc}"}
    if raw is None:
        return {"invalid": "no --kv-transfer-config in the executed command"}
    try:
        cfg = json.loads(raw)
    except ValueError:
        return {"invalid": f"--kv-transfer-config is not JSON: {raw}"}
    return cfg if isinstance(cfg, dict) else {"invalid": f"not a JSON object: {raw}"}


def id_list(value: str) -> list[str]:
    """A comma list as Compose users write it (empty entries kept, so they can be reported)."""
    return [part.strip() for part in value.split(",")] if value.strip() else []


def gpu_requests(service: Service) -> list[Mapping[str, Any]]:
    """The service's GPU device requests (deploy reservations with the gpu capability)."""
    reservations = (service.get("deploy") or {}).get("resources", {}).get("reservations", {})
    return [d for d in reservations.get("devices") or [] if "gpu" in (d.get("capabilities") or [])]


def gpu_device_ids(service: Service) -> list[str]:
    """GPU ids the service reserves (an entry may itself be a comma list: "0,1")."""
    ids: list[str] = []
    for device in gpu_requests(service):
        for entry in device.get("device_ids") or []:
            ids.extend(id_list(str(entry)))
    return ids


def reserves_all_gpus(service: Service) -> bool:
    """Whether a GPU request gives the container every host GPU (`count: all`, rendered -1)."""
    return any(str(d.get("count")) in ("-1", "all") for d in gpu_requests(service))


def namespace_owner(service: Service, key: str) -> str | None:
    """The service whose IPC or PID namespace (``key``) this one joins (`service:NAME`)."""
    value = str(service.get(key) or "")
    return value.removeprefix("service:") if value.startswith("service:") else None


def namespace_holders(compose: Compose) -> set[str]:
    """Services whose IPC or PID namespace another service joins."""
    return {
        owner
        for service in compose["services"].values()
        for owner in (namespace_owner(service, "ipc"), namespace_owner(service, "pid"))
        if owner
    }


def vllm_services(compose: Compose) -> dict[str, Service]:
    return {n: s for n, s in compose["services"].items() if is_vllm(s)}


def proxy_services(compose: Compose) -> dict[str, Service]:
    return {
        n: s for n, s in compose["services"].items() if "PD_PROXY_PREFILL_DNS" in environment(s)
    }


def is_cpu(service: Service) -> bool:
    return "cpu" in (service.get("profiles") or [])


def network_names(name: str, service: Service) -> set[str]:
    """The names a service answers to on its networks: its own and its aliases."""
    names = {name}
    networks = service.get("networks") or {}
    if isinstance(networks, dict):
        for cfg in networks.values():
            names.update((cfg or {}).get("aliases") or [])
    return names


def bind_mounts(service: Service) -> list[dict[str, Any]]:
    return [v for v in service.get("volumes") or [] if v.get("type") == "bind"]


def size_bytes(value: Any) -> int:
    """A Compose byte size (rendered as a plain number of bytes; "1g" style accepted too)."""
    match = _SIZE.match(str(value).strip())
    if not match:
        raise ValueError(value)
    unit = 1024 ** " kmgt".index(match.group(2).lower() or " ")
    return int(float(match.group(1)) * unit)


def positive_int(settings: Mapping[str, str], name: str, problems: list[str]) -> int | None:
    value = settings.get(name, "")
    if value.isdigit() and int(value) > 0:
        return int(value)
    problems.append(f"{name}={value!r} is not a positive integer")
    return None


# ---------------------------------------------------------------------------------------- checks
def check_kv_roles(compose: Compose, settings: Mapping[str, str]) -> list[str]:
    """Prefill services produce, decode services consume, all through the kit's connector: the
    --kv-transfer-config the entrypoint builds from each service's environment."""
    problems = []
    for name, service in vllm_services(compose).items():
        cfg = kv_config(service) or {}
        if "invalid" in cfg:
            problems.append(f"{name}: {cfg['invalid']}")
            continue
        want = "kv_producer" if name.startswith("prefill") else "kv_consumer"
        if cfg.get("kv_role") != want:
            problems.append(f"{name}: kv_role {cfg.get('kv_role')!r}, want {want!r}")
        if cfg.get("kv_connector") != settings["KV_CONNECTOR"]:
            problems.append(f"{name}: kv_connector {cfg.get('kv_connector')!r}")
        if cfg.get("kv_connector_module_path") != settings["KV_CONNECTOR_MODULE_PATH"]:
            module = cfg.get("kv_connector_module_path")
            problems.append(f"{name}: kv_connector_module_path {module!r}")
    roles = {(kv_config(s) or {}).get("kv_role") for s in vllm_services(compose).values()}
    if not {"kv_producer", "kv_consumer"} <= roles:
        problems.append(f"both kv roles needed, found {sorted(r for r in roles if r)}")
    return problems


def check_gpu_topology(compose: Compose, settings: Mapping[str, str]) -> list[str]:
    """GPU prefill = TP x PCP GPUs with EP, decode = DECODER_TP_SIZE GPUs, disjoint; both see both
    roles' GPUs and decode shares prefill's IPC and PID namespaces (CUDA IPC); flags follow the
    settings."""
    services = compose["services"]
    if "prefill" not in services or "decode" not in services:
        return ["the GPU services prefill and decode are not in the model"]
    prefill, decode = services["prefill"], services["decode"]
    p_args, d_args = command_args(prefill), command_args(decode)
    problems: list[str] = []
    tp = positive_int(settings, "PREFILLER_TP_SIZE", problems)
    pcp = positive_int(settings, "PREFILLER_PCP_SIZE", problems)
    d_tp = positive_int(settings, "DECODER_TP_SIZE", problems)

    flags = [
        ("prefill", p_args, "--tensor-parallel-size", "PREFILLER_TP_SIZE"),
        ("prefill", p_args, "--prefill-context-parallel-size", "PREFILLER_PCP_SIZE"),
        ("prefill", p_args, "--moe-backend", "MOE_BACKEND"),
        ("prefill", p_args, "--gpu-memory-utilization", "PREFILL_GPU_MEMORY_UTILIZATION"),
        ("decode", d_args, "--tensor-parallel-size", "DECODER_TP_SIZE"),
        ("decode", d_args, "--moe-backend", "MOE_BACKEND"),
        ("decode", d_args, "--gpu-memory-utilization", "DECODE_GPU_MEMORY_UTILIZATION"),
    ]
    for role, args, flag, var in flags:
        got = flag_value(args, flag)
        if got != settings[var]:
            problems.append(f"{role}: {flag} {got!r} != {var} {settings[var]!r}")
        if flag == "--gpu-memory-utilization":
            try:
                ok = 0 < float(got or "") <= 1
            except ValueError:
                ok = False
            if not ok:
                problems.append(f"{role}: {flag} {got!r} is not a fraction in (0, 1]")
    if "--enable-expert-parallel" not in p_args:
        problems.append("prefill: --enable-expert-parallel missing")

    p_ids = id_list(environment(prefill).get("KIT_ROLE_GPUS", ""))
    d_ids = id_list(environment(decode).get("KIT_ROLE_GPUS", ""))
    if p_ids != id_list(settings["PREFILL_GPUS"]):
        problems.append(f"prefill: KIT_ROLE_GPUS {p_ids} != PREFILL_GPUS")
    if d_ids != id_list(settings["DECODE_GPUS"]):
        problems.append(f"decode: KIT_ROLE_GPUS {d_ids} != DECODE_GPUS")
    bad = [i for i in p_ids + d_ids if not _GPU_ID.match(i)]
    if bad:
        problems.append(f"{bad} is not a GPU index or UUID")
    # xPyD: PREFILL_REPLICAS / DECODE_REPLICAS copies, each on its own TP x PCP / TP ids.
    p_n = positive_int({"PREFILL_REPLICAS": "1", **settings}, "PREFILL_REPLICAS", problems)
    d_n = positive_int({"DECODE_REPLICAS": "1", **settings}, "DECODE_REPLICAS", problems)
    for role, service, count, var in (
        ("prefill", prefill, p_n, "PREFILL_REPLICAS"),
        ("decode", decode, d_n, "DECODE_REPLICAS"),
    ):
        scale, told = service.get("scale", 1), environment(service).get("KIT_ROLE_REPLICAS")
        if count and (scale != count or told != str(count)):
            problems.append(f"{role}: scale {scale}, KIT_ROLE_REPLICAS {told!r} != {var} {count}")
    if tp and pcp and p_n and len(p_ids) != p_n * tp * pcp:
        problems.append(
            f"prefill has {len(p_ids)} GPUs {p_ids}, PREFILL_REPLICAS x TP x PCP = {p_n * tp * pcp}"
        )
    if d_tp and d_n and len(d_ids) != d_n * d_tp:
        problems.append(
            f"decode has {len(d_ids)} GPUs {d_ids}, DECODE_REPLICAS x TP = {d_n * d_tp}"
        )
    if len(set(p_ids + d_ids)) != len(p_ids) + len(d_ids):
        problems.append(f"GPU ids overlap or repeat: prefill {p_ids}, decode {d_ids}")
    both = set(p_ids) | set(d_ids)
    for name, service in (("prefill", prefill), ("decode", decode)):
        problems += _gpu_visibility(name, service, both)
    problems += _shared_namespaces(services, prefill, decode)
    return problems


def _gpu_visibility(name: str, service: Service, both: set[str]) -> list[str]:
    """Both roles' GPUs visible (every host GPU, or device_ids covering both lists), one GPU per
    device_ids entry, and KIT_ALL_GPUS telling the entrypoint which of the two it is."""
    problems = []
    if not gpu_requests(service):
        return [f"{name}: reserves no GPU"]
    for device in gpu_requests(service):
        for entry in device.get("device_ids") or []:
            if "," in str(entry):
                problems.append(
                    f"{name}: device_ids entry {entry!r} names several GPUs: engines that route "
                    f"driver nvidia through CDI look up the device nvidia.com/gpu={entry}, which "
                    "does not exist; one GPU per entry"
                )
    all_gpus = environment(service).get("KIT_ALL_GPUS", "")
    if reserves_all_gpus(service):
        if all_gpus != "all":
            problems.append(
                f"{name}: sees every host GPU but KIT_ALL_GPUS is {all_gpus!r}, not 'all'"
            )
        return problems
    ids = gpu_device_ids(service)
    if set(ids) != both:
        problems.append(f"{name}: device_ids {ids} do not cover both roles' GPUs {sorted(both)}")
    if set(id_list(all_gpus)) != both:
        problems.append(f"{name}: KIT_ALL_GPUS is not both roles' GPUs {sorted(both)}")
    return problems


def _shared_namespaces(
    services: Mapping[str, Service], prefill: Service, decode: Service
) -> list[str]:
    """prefill and decode join one holder's IPC and PID namespaces (CUDA IPC needs both): a
    service of its own, with Docker's init as PID 1 (so neither server is the PID 1 whose exit
    kills the other), shareable IPC holding /dev/shm, no GPU, the servers' restart policy, and
    keygen's image (the kit's own, present on every path: nothing more to pull)."""
    problems = []
    owners = set()
    for role, service in (("prefill", prefill), ("decode", decode)):
        for key in ("ipc", "pid"):
            owner = namespace_owner(service, key)
            if owner is None or owner in ("prefill", "decode"):
                problems.append(f"{role}: {key} {service.get(key)!r}, want 'service:<holder>'")
            else:
                owners.add(owner)
    if len(owners) > 1:
        problems.append(f"prefill and decode join different namespace holders {sorted(owners)}")
    for name in sorted(owners):
        holder = services.get(name)
        if holder is None:
            problems.append(f"{name}: the namespace holder is not in the model")
            continue
        if holder.get("init") is not True:
            problems.append(
                f"{name}: init {holder.get('init')!r}, want true (Docker's init as PID 1)"
            )
        if holder.get("ipc") != "shareable":
            problems.append(f"{name}: ipc {holder.get('ipc')!r}, want 'shareable'")
        if size_bytes(holder.get("shm_size") or 0) < 1024**3:
            problems.append(f"{name}: shm_size {holder.get('shm_size')!r} (the servers' /dev/shm)")
        if gpu_requests(holder):
            problems.append(f"{name}: reserves GPUs")
        if holder.get("restart") != prefill.get("restart"):
            problems.append(
                f"{name}: restart {holder.get('restart')!r} is not the servers' "
                f"{prefill.get('restart')!r} (the engine must bring both back)"
            )
        # The kit's own image, which keygen already needs on every path: nothing more to pull.
        image, kit = holder.get("image"), services.get("keygen", {}).get("image")
        if image != kit:
            problems.append(f"{name}: image {image!r} is not keygen's {kit!r}")
    return problems


# What a cpu-profile server may differ in from its GPU twin (and why); everything else must be
# the same rendered value: one template, the namespaces, the restart policy, the entrypoint.
SERVER_TWINS = (("prefill", "prefill-cpu"), ("decode", "decode-cpu"))
PARITY_ALLOWED = {
    "image": "the vLLM CPU build",
    "build": "the CPU image is built here (images.sh); the GPU one is pulled",
    "pull_policy": "the CPU image exists only locally",
    "profiles": "which deployment",
    "deploy": "GPU devices",
    "cpuset": "CPU knob: the role's cores",
    "cap_add": "CPU knob: SYS_NICE for vLLM's NUMA binding",
    "command": "model and engine flags (the shared ones are compared below)",
    "environment": "GPU ids and CPU knobs (the rest is compared below)",
    "volumes": "the model source (the rest is compared below)",
    "networks": "aliases giving the cpu services the GPU names",
    "ulimits": "memlock for GPU buffers (an engine without CAP_SYS_RESOURCE refuses it)",
}
PARITY_ENV_ALLOWED = frozenset(
    {
        "KIT_ROLE_GPUS",
        "KIT_ALL_GPUS",
        "UCX_TLS",
        "UCX_CUDA_IPC_ENABLE_GET_ZCOPY",
        "KIT_KV_TRANSPORT_CHECK",
        "KIT_KV_BUFFER_DEVICE",
        "KIT_NIXL_PROGRESS_DELAY_US",
        "KIT_NIXL_EARLY_KV_LOAD",
        "KIT_CPU_PCP_SIZE",
        "KIT_CPU_EXPERT_PARALLEL",
        # CPU only: vLLM CPU needs the flag (the kit's plugin keeps it for MLA); GPU vLLM has it
        # on by default.
        "KIT_PREFIX_CACHING",
        "VLLM_CPU_KVCACHE_SPACE",
        "HF_HUB_OFFLINE",
        "VLLM_NO_USAGE_STATS",
    }
)
PARITY_FLAGS = ("--host", "--port", "--max-model-len", "--shutdown-timeout")
MODEL_TARGETS = frozenset({"/root/.cache/huggingface", "/models"})


def check_server_parity(gpu: Compose, cpu: Compose) -> list[str]:
    """The cpu profile's servers against the GPU ones, key by key (PARITY_ALLOWED lists what may
    differ); within the allowed keys, the parts that must still agree."""
    problems = []
    for gpu_name, cpu_name in SERVER_TWINS:
        g, c = gpu["services"].get(gpu_name), cpu["services"].get(cpu_name)
        if g is None or c is None:
            problems.append(f"{gpu_name}/{cpu_name}: not both in the models")
            continue
        for key in sorted(set(g) | set(c)):
            if key not in PARITY_ALLOWED and g.get(key) != c.get(key):
                problems.append(f"{cpu_name}: {key} {c.get(key)!r} != {gpu_name}'s {g.get(key)!r}")
        ge, ce = environment(g), environment(c)
        for var in sorted((set(ge) | set(ce)) - PARITY_ENV_ALLOWED):
            if ge.get(var) != ce.get(var):
                problems.append(
                    f"{cpu_name}: {var} {ce.get(var)!r} != {gpu_name}'s {ge.get(var)!r}"
                )
        ga, ca = command_args(g), command_args(c)
        for flag in PARITY_FLAGS:
            if flag_value(ga, flag) != flag_value(ca, flag):
                problems.append(
                    f"{cpu_name}: {flag} {flag_value(ca, flag)!r} != {gpu_name}'s "
                    f"{flag_value(ga, flag)!r}"
                )

        def mounts(service: Service) -> list[Any]:
            return [v for v in service.get("volumes") or [] if v.get("target") not in MODEL_TARGETS]

        if mounts(g) != mounts(c):
            problems.append(f"{cpu_name}: mounts besides the model differ from {gpu_name}'s")
        g_limits, c_limits = dict(g.get("ulimits") or {}), dict(c.get("ulimits") or {})
        g_limits.pop("memlock", None)
        if g_limits != c_limits:
            problems.append(f"{cpu_name}: ulimits {c_limits} != {gpu_name}'s (memlock aside)")
        if set(g.get("networks") or {}) != set(c.get("networks") or {}):
            problems.append(f"{cpu_name}: networks differ from {gpu_name}'s")
    return problems


def check_cpu_services(compose: Compose, settings: Mapping[str, str]) -> list[str]:
    """CPU prefill/decode: the knobs' cores and topology (the entrypoint splits the cpuset over the
    PCP ranks, so compose must not pin OpenMP itself), NUMA-capable, enough /dev/shm, CPU KV
    buffers without the connector's own core pinning. The two may share cores (a PCP2 prefill and
    a decode on a 2-core machine must)."""
    problems: list[str] = []
    topology = (
        ("prefill-cpu", "PREFILL_CPUS", settings["CPU_PREFILL_PCP_SIZE"]),
        ("decode-cpu", "DECODE_CPUS", "1"),
    )
    for name, cpus_var, want_ranks in topology:
        service = compose["services"].get(name)
        if service is None:
            problems.append(f"{name}: not in the model")
            continue
        env = environment(service)
        cpuset = str(service.get("cpuset", ""))
        if cpuset != settings[cpus_var]:
            problems.append(f"{name}: cpuset {cpuset!r} != {cpus_var} {settings[cpus_var]!r}")
        if "VLLM_CPU_OMP_THREADS_BIND" in env:
            problems.append(
                f"{name}: sets VLLM_CPU_OMP_THREADS_BIND; the entrypoint derives it per rank "
                "from the cpuset"
            )
        if env.get("KIT_CPU_PCP_SIZE") != want_ranks:
            problems.append(
                f"{name}: KIT_CPU_PCP_SIZE {env.get('KIT_CPU_PCP_SIZE')!r}, want {want_ranks!r}"
            )
        try:
            cpu_topology.cpu_topology(env, parse_cpu_list(cpuset))
        except ValueError as exc:
            problems.append(f"{name}: cpuset {cpuset!r}: {exc}")
        if "SYS_NICE" not in (service.get("cap_add") or []):
            problems.append(f"{name}: cap_add lacks SYS_NICE (NUMA memory binding)")
        try:
            shm = size_bytes(service.get("shm_size", "0"))
        except ValueError:
            shm = 0
        if shm < 1024**3:
            problems.append(f"{name}: shm_size {service.get('shm_size')!r} is under 1g")
        if env.get("VLLM_CPU_KVCACHE_SPACE") != settings["KVCACHE_SPACE_GIB"]:
            problems.append(f"{name}: VLLM_CPU_KVCACHE_SPACE != KVCACHE_SPACE_GIB")
        cfg = kv_config(service) or {}
        if "invalid" in cfg:
            problems.append(f"{name}: {cfg['invalid']}")
            continue
        if cfg.get("kv_buffer_device") != "cpu":
            problems.append(f"{name}: kv_buffer_device {cfg.get('kv_buffer_device')!r}, want 'cpu'")
        extra = cfg.get("kv_connector_extra_config") or {}
        if extra.get("cpu_skip_kv_core_pinning") is not True:
            problems.append(f"{name}: cpu_skip_kv_core_pinning is not true")
        delay = extra.get("cpu_nixl_progress_delay_us")
        if str(delay) != settings["NIXL_PROGRESS_DELAY_US"]:
            problems.append(
                f"{name}: cpu_nixl_progress_delay_us {delay!r} != NIXL_PROGRESS_DELAY_US"
            )
    prefill = compose["services"].get("prefill-cpu")
    decode = compose["services"].get("decode-cpu")
    if prefill is not None and decode is not None:
        problems += _shared_namespaces(compose["services"], prefill, decode)
    if prefill is not None:
        ep = environment(prefill).get("KIT_CPU_EXPERT_PARALLEL")
        if ep != settings["CPU_PREFILL_EXPERT_PARALLEL"]:
            problems.append(
                f"prefill-cpu: KIT_CPU_EXPERT_PARALLEL {ep!r} != CPU_PREFILL_EXPERT_PARALLEL"
            )
    return problems


def check_pd_runtime(compose: Compose) -> list[str]:
    """What two P/D containers need for NIXL handshakes, health, weights and start order."""
    problems = []
    ports: dict[str, str] = {}
    for name, service in vllm_services(compose).items():
        env = environment(service)
        # /dev/shm belongs to the IPC namespace: a service joining another's uses that one's.
        shm_owner = namespace_owner(service, "ipc") or name
        if not compose["services"].get(shm_owner, {}).get("shm_size"):
            problems.append(f"{name}: shm_size missing (on {shm_owner})")
        if not is_cpu(service):
            memlock = (service.get("ulimits") or {}).get("memlock", {})
            if memlock != {"soft": -1, "hard": -1} and memlock != -1:
                problems.append(f"{name}: memlock ulimit must be unlimited")
        if not env.get("UCX_TLS"):
            problems.append(f"{name}: UCX_TLS missing")
        # The KV pull is a UCX GET: on GPU cuda_ipc must do it zero-copy (auto turns that off
        # without NVLink, and the pull falls back to emulation over TCP); on CPU TCP is the only
        # path, so nothing may turn emulation off there.
        zcopy = env.get("UCX_CUDA_IPC_ENABLE_GET_ZCOPY")
        if not is_cpu(service) and zcopy != "y":
            problems.append(f"{name}: UCX_CUDA_IPC_ENABLE_GET_ZCOPY {zcopy!r}, want 'y'")
        if is_cpu(service) and (zcopy or env.get("UCX_PROTO_EMULATION_ENABLE")):
            problems.append(f"{name}: forces UCX GET settings on CPU, where TCP is the only path")
        # The GPU servers probe the KV pull before vLLM starts (warn by default); the cpu
        # servers never do: TCP is right there.
        check = env.get("KIT_KV_TRANSPORT_CHECK")
        if not is_cpu(service) and check not in ("warn", "refuse", "off"):
            problems.append(f"{name}: KIT_KV_TRANSPORT_CHECK {check!r}, want warn, refuse or off")
        if is_cpu(service) and check is not None:
            problems.append(
                f"{name}: KIT_KV_TRANSPORT_CHECK set on CPU, where TCP is the only path"
            )
        # Slot leases: every replica of the project locks its slot in one shared volume.
        mounts = {v.get("target"): v for v in service.get("volumes") or []}
        slots = mounts.get(env.get("KIT_SLOT_DIR", ""), {})
        if slots.get("type") != "volume" or slots.get("read_only"):
            problems.append(f"{name}: KIT_SLOT_DIR is not a writable named volume (slot leases)")
        # Left to the entrypoint, which sets the replica's own address: a service name (or any
        # fixed value) would be every replica's with PREFILL_REPLICAS / DECODE_REPLICAS > 1.
        host = env.get("VLLM_NIXL_SIDE_CHANNEL_HOST")
        if host is not None:
            problems.append(
                f"{name}: side-channel host {host!r} is set: leave VLLM_NIXL_SIDE_CHANNEL_HOST "
                "to the entrypoint (each replica's own address)"
            )
        port = env.get("VLLM_NIXL_SIDE_CHANNEL_PORT", "")
        key = f"{is_cpu(service)}:{port}"
        if not port or key in ports:
            problems.append(f"{name}: side-channel port {port!r} missing or reused")
        ports[key] = name
        own_port = flag_value(command_args(service), "--port")
        test = " ".join((service.get("healthcheck") or {}).get("test") or [])
        if f":{own_port}/health" not in test:
            problems.append(f"{name}: healthcheck does not probe /health on port {own_port}")
        targets = [v.get("target") for v in service.get("volumes") or []]
        if is_cpu(service):
            model = flag_value(command_args(service), "--model") or ""
            if not any(t and model.startswith(t + "/") for t in targets):
                problems.append(f"{name}: --model {model!r} is not under a mounted folder")
        elif "/root/.cache/huggingface" not in targets:
            problems.append(f"{name}: HF cache volume missing")
        if not service.get("restart"):
            problems.append(f"{name}: no restart policy")
        keygen = (service.get("depends_on") or {}).get("keygen", {})
        if keygen.get("condition") != "service_completed_successfully":
            problems.append(f"{name}: does not wait for keygen to complete")
    endpoints = service_ports(compose)
    for name, service in proxy_services(compose).items():
        deps = service.get("depends_on") or {}
        servers = [d for d in deps if d.startswith(("prefill", "decode"))]
        # Started, not healthy: one replica that waits (for a slot, for GPU memory) must not hold
        # the proxy back; the proxy routes only to healthy backends and is the stack's readiness.
        if len(servers) != 2 or any(deps[d].get("condition") != "service_started" for d in servers):
            problems.append(f"{name}: must wait for prefill and decode to be started, not healthy")
        env = environment(service)
        # Every replica: a service name (or alias) and its port, resolved by pd-proxy's DNS watch.
        for var in ("PD_PROXY_PREFILL_DNS", "PD_PROXY_DECODE_DNS"):
            host, _, port = env.get(var, "").rpartition(":")
            if not port.isdigit() or int(port) not in endpoints.get(host, set()):
                problems.append(f"{name}: {var} {env.get(var)!r} is no compose service port")
            if var.removesuffix("_DNS") in env:
                problems.append(
                    f"{name}: {var.removesuffix('_DNS')} fixes one backend besides {var}"
                )
    return problems


def check_exposure(compose: Compose, debug_ports: bool = False) -> list[str]:
    """Only the proxy may listen beyond 127.0.0.1; the vLLM servers publish nothing (loopback
    only with compose/debug-ports.yaml)."""
    problems = []
    vllm, proxies = vllm_services(compose), proxy_services(compose)
    for name, service in compose["services"].items():
        for port in service.get("ports") or []:
            where = f"{port.get('published')}->{port.get('target')}"
            if name in vllm and not debug_ports:
                problems.append(f"{name}: publishes {where} (only compose/debug-ports.yaml may)")
            if name not in proxies and port.get("host_ip") != LOOPBACK:
                host = port.get("host_ip") or "every interface"
                problems.append(f"{name}: publishes {where} on {host}, not {LOOPBACK}")
    return problems


def published(compose: Compose) -> dict[str, list[tuple[str, int]]]:
    """service -> [(host_ip, container port)] of what it publishes."""
    return {
        name: [(p.get("host_ip", ""), int(p["target"])) for p in service.get("ports") or []]
        for name, service in compose["services"].items()
    }


def check_least_privilege(compose: Compose) -> list[str]:
    """Proxy, Prometheus, keygen and the namespace holder run read-only with all capabilities
    dropped; no service may gain privileges; the vLLM servers add nothing but SYS_NICE (CPU only);
    keygen adds back only what staging another user's secret file for a third uid takes (CHOWN,
    DAC_READ_SEARCH)."""
    problems = []
    vllm = vllm_services(compose)
    locked = [*proxy_services(compose), "prometheus", "keygen", *sorted(namespace_holders(compose))]
    for name, service in compose["services"].items():
        if NO_NEW_PRIVILEGES not in (service.get("security_opt") or []):
            problems.append(f"{name}: no {NO_NEW_PRIVILEGES}")
        if service.get("privileged"):
            problems.append(f"{name}: privileged")
        allowed = {"SYS_NICE"} if name in vllm and is_cpu(service) else set()
        if name == "keygen":
            allowed = {"CHOWN", "DAC_READ_SEARCH"}
        extra = set(service.get("cap_add") or []) - allowed
        if extra:
            problems.append(f"{name}: cap_add {sorted(extra)}")
        if name in locked:
            if service.get("read_only") is not True:
                problems.append(f"{name}: root filesystem not read_only")
            if "ALL" not in (service.get("cap_drop") or []):
                problems.append(f"{name}: capabilities not dropped (cap_drop ALL)")
    for name in locked:
        if name not in compose["services"]:
            problems.append(f"{name}: not in the model")
    return problems


def check_secrets(compose: Compose) -> list[str]:
    """Secrets reach the containers as files, never as environment values: the kit_secrets folder
    in the vLLM servers (root) and keygen, which stages the proxies' and Grafana's files with the
    generated vLLM key in the kit-keys volume, read-only for every reader."""
    problems = []
    for name, service in compose["services"].items():
        for key in environment(service):
            if key in SECRET_ENV or _SECRET_LIKE.search(key):
                problems.append(f"{name}: secret-looking environment value {key}")
    secret = (compose.get("secrets") or {}).get("kit_secrets", {})
    if not Path(secret.get("file", "/nonexistent")).is_dir():
        problems.append(f"secret kit_secrets: {secret.get('file')!r} is not the secrets folder")
    vllm, proxies = vllm_services(compose), proxy_services(compose)
    has_grafana = "grafana" in compose["services"]
    for name in [*vllm, "keygen"]:
        sources = {s.get("source") for s in compose["services"][name].get("secrets") or []}
        if "kit_secrets" not in sources:
            problems.append(f"{name}: kit_secrets not mounted")
    for name in [*vllm, *proxies, *(["grafana"] if has_grafana else [])]:
        keys = [
            v
            for v in compose["services"][name].get("volumes") or []
            if v.get("source") == "kit-keys"
        ]
        if not keys or not all(v.get("read_only") for v in keys):
            problems.append(f"{name}: kit-keys not mounted read-only")
    for name, service in proxies.items():
        key_file = environment(service).get("PD_PROXY_BACKEND_API_KEY_FILE", "")
        targets = [v["target"] for v in service.get("volumes") or [] if v["source"] == "kit-keys"]
        if not any(key_file.startswith(t + "/") for t in targets):
            problems.append(f"{name}: PD_PROXY_BACKEND_API_KEY_FILE {key_file!r} not in kit-keys")
    keygen = compose["services"].get("keygen", {})
    if keygen.get("network_mode") != "none":
        problems.append("keygen: has a network")
    grafana = compose["services"].get("grafana")
    if grafana is not None:
        anonymous = environment(grafana).get("GF_AUTH_ANONYMOUS_ENABLED", "")
        if anonymous.lower() != "false":
            problems.append(f"grafana: anonymous access {anonymous!r}, want 'false'")
    return problems


def check_connector_mount(compose: Compose, module_path: str) -> list[str]:
    """The connector is mounted read-only at a PYTHONPATH entry that holds ``module_path``."""
    problems = []
    rel = Path(*module_path.split("."))
    for name, service in vllm_services(compose).items():
        pythonpath = environment(service).get("PYTHONPATH", "").split(":")
        hits = [m for m in bind_mounts(service) if m.get("target") in pythonpath]
        if not hits:
            problems.append(f"{name}: no bind mount at a PYTHONPATH entry {pythonpath}")
        for mount in hits:
            source = Path(mount["source"])
            if not ((source / rel).is_dir() or (source / rel).with_suffix(".py").is_file()):
                problems.append(f"{name}: {source} has no module {module_path}")
            if mount.get("read_only") is not True:
                problems.append(f"{name}: connector mount {mount['target']} is not read-only")
    return problems


def service_ports(compose: Compose) -> dict[str, set[int]]:
    """Service name or network alias -> container ports it listens on."""
    out: dict[str, set[int]] = {}
    for name, service in compose["services"].items():
        args, env = command_args(service), environment(service)
        found = {flag_value(args, "--port"), env.get("PD_PROXY_PORT")}
        found.add(env.get("PD_PROXY_METRICS_PORT"))
        found.add((flag_value(args, "--web.listen-address") or "").rpartition(":")[2])
        values = {int(p) for p in found if p and p.isdigit()}
        values |= {int(p["target"]) for p in service.get("ports") or []}
        for alias in network_names(name, service):
            out.setdefault(alias, set()).update(values)
    return out


def metrics_ports(compose: Compose) -> dict[str, set[int]]:
    """Service name or alias -> the port its /metrics answers on (vLLM: its API port; the proxy:
    PD_PROXY_METRICS_PORT, else its API port)."""
    out: dict[str, set[int]] = {}
    for name, service in compose["services"].items():
        env = environment(service)
        port = (
            flag_value(command_args(service), "--port") if name in vllm_services(compose) else None
        )
        if name in proxy_services(compose):
            port = env.get("PD_PROXY_METRICS_PORT") or env.get("PD_PROXY_PORT")
        if port and port.isdigit():
            for alias in network_names(name, service):
                out.setdefault(alias, set()).add(int(port))
    return out


def scrape_targets(job: Mapping[str, Any]) -> list[str]:
    """HOST:PORT of a scrape job's static targets and DNS service-discovery names (A records:
    every replica of a compose service)."""
    targets = [t for static in job.get("static_configs", []) for t in static.get("targets", [])]
    for sd in job.get("dns_sd_configs", []):
        targets += [f"{name}:{sd.get('port')}" for name in sd.get("names", [])]
    return targets


def check_prometheus_targets(compose: Compose, prom: Mapping[str, Any]) -> list[str]:
    """Every scrape target is a compose service/alias on the port its /metrics answers on;
    prefill, decode and proxy are all scraped."""
    endpoints = metrics_ports(compose)
    problems, scraped = [], set()
    for job in prom.get("scrape_configs", []):
        for target in scrape_targets(job):
            host, _, port = target.rpartition(":")
            if not port.isdigit() or int(port) not in endpoints.get(host, set()):
                have = sorted(endpoints.get(host, set()))
                problems.append(f"job {job['job_name']}: {target} serves no /metrics {have}")
            else:
                scraped.add(host)
    missing = {"prefill", "decode", "proxy"} - scraped
    if missing:
        problems.append(f"not scraped: {sorted(missing)}")
    return problems


def check_monitoring_mounts(compose: Compose, rule_files: list[str]) -> list[str]:
    """Prometheus finds its --config.file and rule files in a read-only bind mount; every
    Prometheus/Grafana bind source exists."""
    problems = []
    for name in ("prometheus", "grafana"):
        service = compose["services"].get(name)
        if service is None:
            continue
        for mount in bind_mounts(service):
            if not Path(mount["source"]).exists():
                problems.append(f"{name}: bind source {mount['source']} missing")
            if mount.get("read_only") is not True:
                problems.append(f"{name}: {mount['target']} is not read-only")
    prometheus = compose["services"].get("prometheus")
    if prometheus is None:
        return [*problems, "prometheus: not in the model"]
    config_file = flag_value(command_args(prometheus), "--config.file") or ""
    folder, _, filename = config_file.rpartition("/")
    source = next((m["source"] for m in bind_mounts(prometheus) if m["target"] == folder), None)
    if source is None:
        return [*problems, f"prometheus: nothing mounted at {folder!r} (--config.file)"]
    for rel in [filename, *rule_files]:
        if not (Path(source) / rel).is_file():
            problems.append(f"prometheus: {rel} not in {source}")
    return problems


def check_builds(compose: Compose) -> list[str]:
    """Every build's context and Dockerfile exist."""
    problems = []
    for name, service in compose["services"].items():
        build = service.get("build")
        if not build:
            continue
        context = Path(build["context"])
        dockerfile = context / build.get("dockerfile", "Dockerfile")
        if not context.is_dir():
            problems.append(f"{name}: build context {context} missing")
        if not dockerfile.is_file():
            problems.append(f"{name}: {dockerfile} missing")
    return problems


def split_image(image: str) -> tuple[str, str | None, str | None]:
    """``repo[:tag][@digest]`` -> (repo, tag, digest); a registry's :port is not a tag."""
    name, _, digest = image.partition("@")
    head, _, last = name.rpartition("/")
    repo, _, tag = last.partition(":")
    return (f"{head}/{repo}" if head else repo), tag or None, digest or None


def check_images_pinned(compose: Compose, vllm_version: str) -> list[str]:
    """Every image and build base has an explicit tag (not latest) or digest; tagged vLLM images
    are the pinned vLLM release."""
    problems = []
    for name, service in compose["services"].items():
        images = {"image": service.get("image")}
        for arg, value in ((service.get("build") or {}).get("args") or {}).items():
            if arg.endswith("BASE_IMAGE"):
                images[f"build arg {arg}"] = value
        for what, image in images.items():
            if not image:
                continue
            repo, tag, digest = split_image(image)
            if not digest and tag in (None, "latest"):
                problems.append(f"{name}: {what} {image!r} is not pinned")
            elif tag and "vllm" in repo and not tag.startswith(f"v{vllm_version}"):
                problems.append(f"{name}: {what} {image!r} is not vLLM v{vllm_version}")
    return problems


# ---------------------------------------------------------------------------------------- variables
_DEFAULTED = re.compile(r"\$(?:\$|\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?+])([^}]*))?\})")


def variable_uses(text: str) -> list[tuple[str, str | None, str]]:
    """(name, operator or None, default text) for every ${...} in a compose file's text, comment
    lines skipped. --variables reports one default per name; this sees each use."""
    body = "\n".join(ln for ln in text.splitlines() if not ln.lstrip().startswith("#"))
    return [
        (m.group(1), m.group(2), m.group(3) or "")
        for m in _DEFAULTED.finditer(body)
        if m.group(0) != "$$"
    ]


def check_variable_defaults(
    uses: list[tuple[str, str | None, str]], env_example: Mapping[str, str]
) -> list[str]:
    """Every ${VAR} has a :- default or a .env.example line; every default equals that line."""
    problems = []
    for name, op, default in uses:
        if op in (":-", "-"):
            if name in env_example and default != env_example[name]:
                problems.append(
                    f"{name}: default {default!r} != .env.example {env_example[name]!r}"
                )
        elif name not in env_example:
            problems.append(f"{name}: neither a ':-' default nor a .env.example line")
    return sorted(set(problems))


# The keys preflight reads from x-kit-settings and the knob behind each: one table, preflight's.
KIT_SETTINGS = {**ENV_NAMES, **OPTIONAL_ENV_NAMES}
REQUIRED_KIT_SETTINGS = set(REQUIRED)


def check_kit_settings(compose: Compose, settings: Mapping[str, str]) -> list[str]:
    """x-kit-settings (what tools read) shows the knob each key names, as rendered."""
    block = compose.get("x-kit-settings") or {}
    problems = [f"x-kit-settings: {k} missing" for k in sorted(REQUIRED_KIT_SETTINGS - set(block))]
    for key, var in KIT_SETTINGS.items():
        if key in block and str(block[key]) != settings[var]:
            problems.append(f"x-kit-settings: {key} {block[key]!r} != {var} {settings[var]!r}")
    return problems
