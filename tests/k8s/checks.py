"""Semantic checks on rendered manifests. Each returns a list of problems (empty = fine), so the
tests show that a check passes on the real render *and* fails on a broken copy of it."""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from tests.entrypoint.loader import CONTAINER_PATH, effective_argv, replica
from tests.entrypoint.loader import gpus as entrypoint_gpus
from tests.k8s.manifests import (
    ALERTS,
    CONNECTOR_PKG,
    ENTRYPOINT,
    Obj,
    PodTemplate,
    container_env,
    exec_argv,
    find,
    generated,
    parse_flags,
    pod_templates,
    role_templates,
    selects,
    walk_containers,
)

VLLM_CONTAINER = "vllm"
PROXY_DEPLOYMENT = "pcp-pd-proxy"
ENTRYPOINT_PROGRAMS = ("python3", "vllm")
# The secrets the manifests expect to exist (created by hand, docs/kubernetes.md).
EXPECTED_SECRETS = {"pcp-pd-vllm-api-key", "pcp-pd-kit-secrets"}

_QUANTITY = re.compile(r"^(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|Pi|k|M|G|T|P)?$")
_FACTORS = {
    None: 1,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
}


def quantity_bytes(value: str) -> int:
    m = _QUANTITY.match(str(value))
    if not m:
        raise ValueError(f"not a Kubernetes quantity: {value!r}")
    return int(float(m.group(1)) * _FACTORS[m.group(2)])


def docker_size_bytes(value: str) -> int:
    """Docker's sizes (shm_size: 16g): b/k/m/g suffixes, powers of 1024."""
    m = re.fullmatch(r"(\d+)([bkmg]?)", str(value).strip().lower())
    if not m:
        raise ValueError(f"not a Docker size: {value!r}")
    return int(m.group(1)) * {"": 1, "b": 1, "k": 2**10, "m": 2**20, "g": 2**30}[m.group(2)]


def duration_seconds(value: str) -> int:
    """Go durations as Compose prints them (30m0s, 20s, 1h)."""
    parts = re.findall(r"(\d+)([hms])", str(value))
    if not parts or "".join(n + u for n, u in parts) != str(value):
        raise ValueError(f"not a duration: {value!r}")
    return sum(int(n) * {"h": 3600, "m": 60, "s": 1}[u] for n, u in parts)


def params(objs: list[Obj]) -> dict[str, str]:
    return dict(generated(objs, "ConfigMap", "pcp-pd-params").get("data", {}))


def gpus(container: Obj) -> int:
    return int(container.get("resources", {}).get("limits", {}).get("nvidia.com/gpu", 0))


def vllm_argv(template: PodTemplate, objs: list[Obj]) -> list[str]:
    """The argv vLLM finally runs with: the container's command (run with stubs), then what the
    kit's entrypoint makes of it and the pod's environment (its own pure function, so the
    --kv-transfer-config it builds is in). ValueError, with the entrypoint's reason, where it
    would refuse to start."""
    container = template.container(VLLM_CONTAINER)
    env = container_env(container, objs, template.injected)
    return effective_argv(exec_argv(container, env, ENTRYPOINT_PROGRAMS), env)


def flag(argv: list[str], name: str) -> str | None:
    values = parse_flags(argv)[1].get(name)
    return values[-1] if values else None


def kv_config(argv: list[str]) -> dict[str, Any]:
    raw = flag(argv, "--kv-transfer-config")
    return json.loads(raw) if raw else {}


def container_ports(template: PodTemplate) -> dict[str, int]:
    return {
        p["name"]: int(p["containerPort"])
        for c in walk_containers(template)
        for p in c.get("ports", [])
        if "name" in p
    }


def mounts(container: Obj) -> dict[str, str]:
    """mountPath -> volume name."""
    return {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}


def volume(template: PodTemplate, name: str) -> Obj:
    for v in template.spec.get("volumes", []):
        if v["name"] == name:
            return v
    raise KeyError(f"{template.owner}: no volume {name!r}")


def files_provided(template: PodTemplate, container: Obj) -> dict[str, tuple[str, str, str]]:
    """Files the container sees from ConfigMap/Secret volumes, projected ones included:
    path -> (kind, name, key). Without `items`, every key is a file; with them, only the listed
    ones (at their `path`)."""
    out: dict[str, tuple[str, str, str]] = {}
    for mount_path, vol_name in mounts(container).items():
        vol = volume(template, vol_name)
        sources = [(vol, "secretName")]
        sources += [(src, "name") for src in vol.get("projected", {}).get("sources", [])]
        for holder, secret_field in sources:
            for kind, name_field in (("configMap", "name"), ("secret", secret_field)):
                if kind not in holder:
                    continue
                _add_files(out, mount_path, kind, holder[kind], name_field)
    return out


def _add_files(
    out: dict[str, tuple[str, str, str]], mount_path: str, kind: str, source: Obj, name_field: str
) -> None:
    items = source.get("items")
    if not items:
        out[f"{mount_path}/*"] = (kind, source[name_field], "*")
        return
    for item in items:
        out[f"{mount_path}/{item['path']}"] = (kind, source[name_field], item["key"])


def provides(files: Mapping[str, tuple[str, str, str]], path: str) -> tuple[str, str, str] | None:
    if path in files:
        return files[path]
    parent = path.rsplit("/", 1)[0]
    whole = files.get(f"{parent}/*")
    return (whole[0], whole[1], path.rsplit("/", 1)[1]) if whole else None


# ----------------------------------------------------------------------------- topology


def check_service_selectors(objs: list[Obj]) -> list[str]:
    """Every Service selects pods; a role's Service selects only that role's pods, and its
    targetPort names a port of each of them."""
    problems = []
    templates = pod_templates(objs)
    for svc in find(objs, "Service"):
        name = svc["metadata"]["name"]
        selector = svc["spec"].get("selector", {})
        chosen = [t for t in templates if selects(selector, t.labels)]
        if not chosen:
            problems.append(f"Service {name} selects no pod template (selector {selector})")
            continue
        role = svc["metadata"].get("labels", {}).get("llm-d.ai/role")
        if role:
            strays = [t.owner for t in chosen if t.labels.get("llm-d.ai/role") != role]
            if strays:
                problems.append(f"Service {name} (role {role}) also selects {strays}")
        for port in svc["spec"].get("ports", []):
            target = port.get("targetPort", port["port"])
            for t in chosen:
                ports = container_ports(t)
                ok = target in ports if isinstance(target, str) else target in ports.values()
                if not ok:
                    problems.append(f"Service {name} targetPort {target!r} missing in {t.owner}")
    return problems


def check_headless_roles(objs: list[Obj]) -> list[str]:
    """One headless Service per vLLM role (the proxy and Prometheus resolve them by DNS)."""
    problems = []
    for role in ("prefill", "decode"):
        svcs = [
            s
            for s in find(objs, "Service")
            if s["metadata"].get("labels", {}).get("llm-d.ai/role") == role
        ]
        if len(svcs) != 1:
            problems.append(f"{len(svcs)} Services for role {role}, want 1")
        elif svcs[0]["spec"].get("clusterIP") != "None":
            problems.append(f"Service {svcs[0]['metadata']['name']} is not headless")
    return problems


def check_gpus(objs: list[Obj]) -> list[str]:
    """GPUs of one instance: TP x PCP for prefill, TP for decode (summed over an LWS group)."""
    p = params(objs)
    want = {
        "prefill": int(p["PREFILLER_TP_SIZE"]) * int(p["PREFILLER_PCP_SIZE"]),
        "decode": int(p["DECODER_TP_SIZE"]),
    }
    problems = []
    for role, expected in want.items():
        for o in find(objs, "Deployment"):
            t = o["spec"]["template"]
            if t["metadata"].get("labels", {}).get("llm-d.ai/role") != role:
                continue
            got = sum(gpus(c) for c in t["spec"]["containers"])
            if got != expected:
                problems.append(f"Deployment {o['metadata']['name']}: {got} GPUs, want {expected}")
        for o in find(objs, "LeaderWorkerSet"):
            lwt = o["spec"]["leaderWorkerTemplate"]
            leader = lwt.get("leaderTemplate", lwt["workerTemplate"])
            if leader["metadata"].get("labels", {}).get("llm-d.ai/role") != role:
                continue
            size = int(lwt.get("size", 1))
            per_leader = sum(gpus(c) for c in leader["spec"]["containers"])
            per_worker = sum(gpus(c) for c in lwt["workerTemplate"]["spec"]["containers"])
            got = per_leader + per_worker * (size - 1)
            if got != expected or not per_leader or not per_worker:
                problems.append(
                    f"LeaderWorkerSet {o['metadata']['name']}: {per_leader} + {per_worker} x "
                    f"{size - 1} GPUs, want {expected} in all and some on every pod"
                )
    for role in want:
        if not role_templates(objs, role):
            problems.append(f"no {role} pods")
    return problems


def instances(objs: list[Obj]) -> dict[str, tuple[int, int]]:
    """Per role: (instances, GPUs of one instance). An instance is a Deployment's pod or an LWS
    group (leader + size - 1 workers): one vLLM server, as one compose replica is."""
    found: dict[str, tuple[int, int]] = {}
    for o in find(objs, "Deployment"):
        t = o["spec"]["template"]
        role = t["metadata"].get("labels", {}).get("llm-d.ai/role")
        if role in ("prefill", "decode"):
            per = sum(gpus(c) for c in t["spec"]["containers"])
            found[role] = (int(o["spec"].get("replicas", 1)), per)
    for o in find(objs, "LeaderWorkerSet"):
        lwt = o["spec"]["leaderWorkerTemplate"]
        leader = lwt.get("leaderTemplate", lwt["workerTemplate"])
        role = leader["metadata"].get("labels", {}).get("llm-d.ai/role")
        if role in ("prefill", "decode"):
            size = int(lwt.get("size", 1))
            per = sum(gpus(c) for c in leader["spec"]["containers"])
            per += (size - 1) * sum(gpus(c) for c in lwt["workerTemplate"]["spec"]["containers"])
            found[role] = (int(o["spec"].get("replicas", 1)), per)
    return found


def check_replica_meaning(objs: list[Obj], compose: Mapping[str, Any]) -> list[str]:
    """The renders' instance counts mean what compose's PREFILL_REPLICAS / DECODE_REPLICAS mean:
    ``compose`` is compose.yaml rendered with the knobs set to those counts, and each role's
    service must scale to the same count, each replica (its slice of the role's GPU list, by the
    entrypoint's own rule) taking as many GPUs as one instance requests."""
    problems = []
    for role, (count, per) in sorted(instances(objs).items()):
        service = compose["services"][role]
        env = {k: str(v) for k, v in (service.get("environment") or {}).items()}
        scale = int(service.get("scale", 1))
        if scale != count:
            problems.append(f"{role}: {count} instance(s) on Kubernetes, compose scales to {scale}")
            continue
        argv = [str(a) for a in service.get("command") or []]
        ids = [i.strip() for i in env.get("KIT_ROLE_GPUS", "").split(",") if i.strip()]
        try:
            every = [
                entrypoint_gpus.replica_gpus(
                    ids, scale, entrypoint_gpus.gpus_per_replica(argv), index
                )
                for index in range(1, scale + 1)
            ]
        except ValueError as exc:
            problems.append(f"{role}: compose's entrypoint refuses: {exc}")
            continue
        if any(len(own) != per for own in every):
            problems.append(
                f"{role}: a compose replica takes {[len(own) for own in every]} GPU(s), an "
                f"instance on Kubernetes {per}"
            )
    return problems


def check_pods_pick_no_gpus(objs: list[Obj]) -> list[str]:
    """Each vLLM pod gets its GPUs from the device plugin: the entrypoint must pick none (no
    KIT_ROLE_GPUS) and take the pod for one replica without looking anything up."""

    def no_lookup() -> int:
        raise ValueError("looked up a replica index")

    problems = []
    for role in ("prefill", "decode"):
        for t in role_templates(objs, role):
            container = t.container(VLLM_CONTAINER)
            env = container_env(container, objs, t.injected)
            try:
                place = replica.placement(env, vllm_argv(t, objs), no_lookup)
            except ValueError as exc:
                problems.append(f"{t.owner}: {exc}")
                continue
            if tuple(place) != (1, 1, []):
                problems.append(f"{t.owner}: the entrypoint places it as {tuple(place)}")
    return problems


# ----------------------------------------------------------------------------- vLLM pods


def connector_paths() -> dict[str, str]:
    """ConfigMap key -> path in the package, for every .py file (subpackages: ``a/b.py`` is the
    key ``a.b.py``, since a key cannot hold a ``/``)."""
    return {
        p.relative_to(CONNECTOR_PKG).as_posix().replace("/", "."): p.relative_to(
            CONNECTOR_PKG
        ).as_posix()
        for p in sorted(CONNECTOR_PKG.rglob("*.py"))
        if "__pycache__" not in p.parts
    }


def connector_files() -> dict[str, str]:
    """The package's files as the ConfigMap holds them: key -> text."""
    return {key: (CONNECTOR_PKG / rel).read_text() for key, rel in connector_paths().items()}


def check_connector_configmap(objs: list[Obj]) -> list[str]:
    """The ConfigMap is exactly connector/pcp_nixl_connector: one key per file, same bytes."""
    problems = []
    data = generated(objs, "ConfigMap", "pcp-pd-connector").get("data", {})
    files = connector_files()
    for name in sorted(set(files) - set(data)):
        problems.append(f"connector file {name} is missing from the ConfigMap (make k8s-sources)")
    for name in sorted(set(data) - set(files)):
        problems.append(f"ConfigMap key {name} is not a file of the connector package")
    for name in sorted(set(files) & set(data)):
        if data[name] != files[name]:
            problems.append(
                f"ConfigMap key {name} differs from connector/pcp_nixl_connector/{name}"
            )
    return problems


def connector_classes() -> set[str]:
    names = set()
    for path in CONNECTOR_PKG.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                names.add(node.name)
    return names


def check_vllm_connector(objs: list[Obj]) -> list[str]:
    """Every vLLM container loads the kit's connector: kv_connector is a class of the package,
    kv_connector_module_path is the package, mounted from the connector ConfigMap at
    <dir on PYTHONPATH>/<module>, and the role matches the pod's, in the --kv-transfer-config the
    entrypoint builds from the pod's environment."""
    problems = []
    p = params(objs)
    connector_cm = generated(objs, "ConfigMap", "pcp-pd-connector")["metadata"]["name"]
    classes = connector_classes()
    for role, kv_role in (("prefill", "kv_producer"), ("decode", "kv_consumer")):
        for t in role_templates(objs, role):
            container = t.container(VLLM_CONTAINER)
            env = container_env(container, objs, t.injected)
            try:
                cfg = kv_config(vllm_argv(t, objs))
            except ValueError as exc:
                problems.append(f"{t.owner}: the entrypoint refuses to start: {exc}")
                continue
            module = cfg.get("kv_connector_module_path", "")
            if cfg.get("kv_role") != kv_role:
                problems.append(f"{t.owner}: kv_role {cfg.get('kv_role')!r}, want {kv_role}")
            if cfg.get("kv_connector") != p["KV_CONNECTOR"] or p["KV_CONNECTOR"] not in classes:
                problems.append(
                    f"{t.owner}: kv_connector {cfg.get('kv_connector')!r} is not a "
                    f"class of the connector package"
                )
            if module != p["KV_CONNECTOR_MODULE_PATH"] or module != CONNECTOR_PKG.name:
                problems.append(f"{t.owner}: kv_connector_module_path {module!r}")
            pythonpath = [d for d in env.get("PYTHONPATH", "").split(":") if d]
            mounted = [
                path
                for path, vol in mounts(container).items()
                if volume(t, vol).get("configMap", {}).get("name") == connector_cm
            ]
            if not any(
                path.rsplit("/", 1)[1] == module and path.rsplit("/", 1)[0] in pythonpath
                for path in mounted
            ):
                problems.append(
                    f"{t.owner}: connector ConfigMap mounted at {mounted}, PYTHONPATH "
                    f"{pythonpath}: `import {module}` would not find it"
                )
            for m in mounted:
                source = volume(t, mounts(container)[m]).get("configMap", {})
                items = source.get("items")
                got = {i["path"]: i["key"] for i in items} if items else None
                want = {rel: key for key, rel in connector_paths().items()}
                if got is None and any("/" in rel for rel in want):
                    problems.append(f"{t.owner}: no items: the subpackages' files land flat")
                elif got is not None and got != want:
                    missing = sorted(set(want) - set(got))
                    problems.append(f"{t.owner}: connector items map {got}, missing {missing}")
    return problems


def check_side_channel(objs: list[Obj]) -> list[str]:
    """NIXL side channel: host = the pod's own IP, port = a declared container port."""
    problems = []
    for role in ("prefill", "decode"):
        for t in role_templates(objs, role):
            container = t.container(VLLM_CONTAINER)
            item = next(
                (e for e in container.get("env", []) if e["name"] == "VLLM_NIXL_SIDE_CHANNEL_HOST"),
                None,
            )
            ref = (item or {}).get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
            if ref != "status.podIP":
                problems.append(f"{t.owner}: VLLM_NIXL_SIDE_CHANNEL_HOST is not status.podIP")
            env = container_env(container, objs, t.injected)
            port = env.get("VLLM_NIXL_SIDE_CHANNEL_PORT", "")
            if not port.isdigit() or container_ports(t).get("nixl-side") != int(port):
                problems.append(
                    f"{t.owner}: side-channel port {port!r} is not the nixl-side container port "
                    f"{container_ports(t).get('nixl-side')}"
                )
    return problems


def check_vllm_http(objs: list[Obj], start_period_s: int) -> list[str]:
    """The API server's --port is the `http` container port, probed on /health; the startup probe
    allows the compose start period."""
    problems = []
    for role in ("prefill", "decode"):
        for t in role_templates(objs, role):
            if t.role == "worker":
                continue
            container = t.container(VLLM_CONTAINER)
            port = flag(vllm_argv(t, objs), "--port")
            if str(container_ports(t).get("http")) != port:
                problems.append(f"{t.owner}: --port {port} but http port {container_ports(t)}")
            for probe in ("readinessProbe", "startupProbe", "livenessProbe"):
                get = container.get(probe, {}).get("httpGet", {})
                if get.get("path") != "/health" or get.get("port") != "http":
                    problems.append(f"{t.owner}: {probe} is not GET /health on http")
            startup = container.get("startupProbe", {})
            window = startup.get("periodSeconds", 10) * startup.get("failureThreshold", 3)
            if window < start_period_s:
                problems.append(f"{t.owner}: startup window {window}s < {start_period_s}s")
    return problems


def check_shm(objs: list[Obj], shm_bytes: int) -> list[str]:
    """/dev/shm is a memory emptyDir of SHM_SIZE in every vLLM container."""
    problems = []
    for t in role_templates(objs, "prefill") + role_templates(objs, "decode"):
        container = t.container(VLLM_CONTAINER)
        name = mounts(container).get("/dev/shm")
        if name is None:
            problems.append(f"{t.owner}: no /dev/shm mount")
            continue
        empty = volume(t, name).get("emptyDir")
        if empty is None or empty.get("medium") != "Memory":
            problems.append(f"{t.owner}: /dev/shm is not a memory emptyDir")
        elif quantity_bytes(empty.get("sizeLimit", "0")) != shm_bytes:
            problems.append(f"{t.owner}: /dev/shm sizeLimit {empty.get('sizeLimit')} != SHM_SIZE")
    return problems


def entrypoint_paths() -> dict[str, str]:
    """The secret file paths the kit's vLLM entrypoint reads (secret_files.py's constants)."""
    out = {}
    for node in ast.parse((ENTRYPOINT / "secret_files.py").read_text()).body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            name = node.targets[0].id if isinstance(node.targets[0], ast.Name) else ""
            if name.endswith("_FILE") and node.value.args:
                out[name] = ast.literal_eval(node.value.args[0])
    return out


def check_vllm_secrets(objs: list[Obj]) -> list[str]:
    """vLLM's API key reaches the entrypoint from the Secret (a file, no env value), the HF token
    file may come from the optional kit Secret, and the entrypoint is the compose one."""
    problems = []
    paths = entrypoint_paths()
    entry_cm = generated(objs, "ConfigMap", "pcp-pd-entrypoint")
    package = {path.name: path.read_text() for path in sorted(ENTRYPOINT.glob("*.py"))}
    if entry_cm.get("data", {}) != package:
        problems.append("the entrypoint ConfigMap differs from compose/entrypoint/vllm_serve")
    for t in role_templates(objs, "prefill") + role_templates(objs, "decode"):
        container = t.container(VLLM_CONTAINER)
        files = files_provided(t, container)
        if t.role != "worker":
            source = provides(files, paths.get("VLLM_KEY_FILE", "?"))
            if source != ("secret", "pcp-pd-vllm-api-key", "vllm_api_key"):
                problems.append(f"{t.owner}: {paths.get('VLLM_KEY_FILE')} comes from {source}")
        # Every vLLM pod runs it, LeaderWorkerSet workers included (it builds their KV config).
        entry = [provides(files, f"{CONTAINER_PATH}/{name}") for name in package]
        if any(e is None or e[1] != entry_cm["metadata"]["name"] for e in entry):
            problems.append(f"{t.owner}: the kit's entrypoint is not mounted")
        token = provides(files, paths.get("HF_TOKEN_FILE", "?"))
        if token is None or token[:2] != ("secret", "pcp-pd-kit-secrets"):
            problems.append(f"{t.owner}: {paths.get('HF_TOKEN_FILE')} comes from {token}")
        for item in container.get("env", []):
            if re.search(r"KEY|TOKEN|PASSWORD", item["name"]) and "value" in item:
                problems.append(f"{t.owner}: secret-like env {item['name']} has a literal value")
    return problems


def known_vllm_env(names: set[str], vllm_envs: set[str]) -> list[str]:
    """vLLM may refuse unknown VLLM_* variables: every one set must be one vLLM knows."""
    return [f"unknown vLLM variable {n}" for n in sorted(names) if n not in vllm_envs]


def vllm_env_names(objs: list[Obj]) -> set[str]:
    names = set()
    for t in role_templates(objs, "prefill") + role_templates(objs, "decode"):
        container = t.container(VLLM_CONTAINER)
        env = container_env(container, objs, t.injected)
        names |= {n for n in env if n.startswith("VLLM_")}
    return names


# ----------------------------------------------------------------------------- proxy


def proxy_template(objs: list[Obj]) -> PodTemplate | None:
    for t in pod_templates(objs):
        if t.owner == f"Deployment/{PROXY_DEPLOYMENT}":
            return t
    return None


PROXY_ACCOUNT = "pcp-pd-proxy"
# The one permission pd-proxy's discovery needs (pd_proxy.discovery.k8s_service: LIST, then WATCH).
PROXY_RULES = [
    {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["list", "watch"]}
]


def service_port(svc: Obj, port: str) -> Obj | None:
    """The Service port ``port`` names: by name, else by number."""
    for entry in svc["spec"].get("ports", []):
        if entry.get("name") == port or str(entry.get("port")) == port:
            return entry
    return None


def check_proxy(objs: list[Obj]) -> list[str]:
    """pd-proxy watches each role's Service through the Kubernetes API (SERVICE:PORT, where PORT
    is a Service port whose target is the pods' `http` port), as a ServiceAccount whose only
    permission is list/watch on EndpointSlices; it reads both keys from Secret files (the backend
    key from the Secret the vLLM pods use) and has a writable /tmp on a read-only root."""
    problems = []
    t = proxy_template(objs)
    if t is None:
        return ["no pd-proxy Deployment"]
    container = t.spec["containers"][0]
    env = container_env(container, objs, t.injected)
    for role in ("prefill", "decode"):
        name = f"PD_PROXY_{role.upper()}_K8S_SERVICE"
        value = env.get(name, "")
        host, _, port = value.partition(":")
        svc = next((s for s in find(objs, "Service") if s["metadata"]["name"] == host), None)
        if svc is None:
            problems.append(f"{name}={value!r}: no Service {host!r}")
            continue
        chosen = [x for x in pod_templates(objs) if selects(svc["spec"]["selector"], x.labels)]
        if not chosen or any(x.labels.get("llm-d.ai/role") != role for x in chosen):
            problems.append(f"Service {host} does not select exactly the {role} pods")
        entry = service_port(svc, port) if port else None
        if entry is None or not port:
            problems.append(f"{name}={value!r}: the Service has no port {port!r}")
            continue
        for x in chosen:
            target = entry.get("targetPort", entry["port"])
            number = container_ports(x).get(target) if isinstance(target, str) else target
            if number != container_ports(x).get("http"):
                problems.append(f"{name}: Service port {port} is not {x.owner}'s http port")
        if f"PD_PROXY_{role.upper()}_DNS" in env:
            problems.append(f"PD_PROXY_{role.upper()}_DNS set as well: one source per role")
    problems += _proxy_identity(objs, t)
    files = files_provided(t, container)
    want = {
        "PD_PROXY_API_KEY_FILE": ("secret", "pcp-pd-kit-secrets", "api_keys"),
        "PD_PROXY_BACKEND_API_KEY_FILE": ("secret", "pcp-pd-vllm-api-key", "vllm_api_key"),
    }
    for name, source in want.items():
        got = provides(files, env.get(name, "?"))
        if got != source:
            problems.append(f"{name}={env.get(name)!r} is provided by {got}, want {source}")
    tmp = mounts(container).get("/tmp")
    if tmp is None or "emptyDir" not in volume(t, tmp):
        problems.append("pd-proxy has no writable /tmp (an emptyDir) on its read-only root")
    if "/health" != (container.get("readinessProbe", {}).get("httpGet", {}).get("path")):
        problems.append("pd-proxy readiness is not GET /health")
    if "httpGet" in container.get("livenessProbe", {}):
        problems.append("pd-proxy liveness must not depend on backends (/health): use tcpSocket")
    return problems


def _proxy_identity(objs: list[Obj], t: PodTemplate) -> list[str]:
    """The proxy's ServiceAccount exists, its token is mounted, and the Roles bound to it grant
    exactly PROXY_RULES (one Role, no ClusterRole)."""
    problems = []
    account = t.spec.get("serviceAccountName")
    if account != PROXY_ACCOUNT or not find(objs, "ServiceAccount", PROXY_ACCOUNT):
        problems.append(
            f"pd-proxy runs as {account!r}, want its own ServiceAccount {PROXY_ACCOUNT}"
        )
    if t.spec.get("automountServiceAccountToken") is not True:
        problems.append("pd-proxy needs its ServiceAccount token mounted to use the API")
    bound = [
        b
        for b in find(objs, "RoleBinding") + find(objs, "ClusterRoleBinding")
        if any(
            s.get("kind") == "ServiceAccount" and s.get("name") == PROXY_ACCOUNT
            for s in b.get("subjects", [])
        )
    ]
    if len(bound) != 1 or bound[0]["kind"] != "RoleBinding":
        problems.append(f"{len(bound)} bindings for {PROXY_ACCOUNT}, want one RoleBinding")
        return problems
    ref = bound[0]["roleRef"]
    role = find(objs, ref["kind"], ref["name"]) if ref.get("kind") == "Role" else []
    if not role:
        problems.append(f"RoleBinding {bound[0]['metadata']['name']} names no rendered Role")
    elif role[0].get("rules") != PROXY_RULES:
        problems.append(f"Role {ref['name']} grants {role[0].get('rules')}, want {PROXY_RULES}")
    return problems


def check_hardening(objs: list[Obj]) -> list[str]:
    """Compose's restrictions carry over: no privilege escalation for vLLM (no-new-privileges),
    and pd-proxy non-root, read-only root, no capabilities (compose's least-privilege); no API
    token in the vLLM pods (the proxy keeps its own: check_proxy)."""
    problems = []
    for t in role_templates(objs, "prefill") + role_templates(objs, "decode"):
        sc = t.container(VLLM_CONTAINER).get("securityContext", {})
        if sc.get("allowPrivilegeEscalation") is not False:
            problems.append(f"{t.owner}: vLLM may escalate privileges")
        # It runs the model's own code (--trust-remote-code) and needs no Kubernetes API.
        if t.spec.get("automountServiceAccountToken") is not False:
            problems.append(f"{t.owner}: the ServiceAccount token is mounted into vLLM's pod")
    t = proxy_template(objs)
    if t is not None:
        sc = t.spec["containers"][0].get("securityContext", {})
        pod = t.spec.get("securityContext", {})
        if not (
            pod.get("runAsNonRoot")
            and sc.get("readOnlyRootFilesystem")
            and sc.get("allowPrivilegeEscalation") is False
            and sc.get("capabilities", {}).get("drop") == ["ALL"]
        ):
            problems.append("pd-proxy is not non-root / read-only / without capabilities")
    return problems


# ----------------------------------------------------------------------------- references


def check_references(objs: list[Obj]) -> list[str]:
    """Every ConfigMap and ServiceAccount a pod uses is rendered; every Secret is one of the
    documented ones."""
    problems = []
    configmaps = {o["metadata"]["name"] for o in find(objs, "ConfigMap")}
    accounts = {o["metadata"]["name"] for o in find(objs, "ServiceAccount")}
    for t in pod_templates(objs):
        account = t.spec.get("serviceAccountName")
        if account is not None and account not in accounts:
            problems.append(f"{t.owner}: ServiceAccount {account} not rendered")
        for v in t.spec.get("volumes", []):
            if "configMap" in v and v["configMap"]["name"] not in configmaps:
                problems.append(
                    f"{t.owner}: volume ConfigMap {v['configMap']['name']} not rendered"
                )
            if "secret" in v and v["secret"]["secretName"] not in EXPECTED_SECRETS:
                problems.append(f"{t.owner}: undocumented Secret {v['secret']['secretName']}")
        for c in walk_containers(t):
            for source in c.get("envFrom", []):
                name = source.get("configMapRef", {}).get("name")
                if name and name not in configmaps:
                    problems.append(f"{t.owner}: envFrom ConfigMap {name} not rendered")
            for item in c.get("env", []):
                ref = item.get("valueFrom", {})
                if "configMapKeyRef" in ref and ref["configMapKeyRef"]["name"] not in configmaps:
                    problems.append(f"{t.owner}: env ConfigMap {ref['configMapKeyRef']['name']}")
                if "secretKeyRef" in ref and ref["secretKeyRef"]["name"] not in EXPECTED_SECRETS:
                    problems.append(f"{t.owner}: undocumented Secret {ref['secretKeyRef']['name']}")
    return problems


# ----------------------------------------------------------------------------- monitoring


# kube-prometheus-stack's Prometheus selects PodMonitors labelled release=<its Helm release>; the
# kit's default release name (an operator input, docs/kubernetes.md).
PROMETHEUS_RELEASE = "kube-prometheus-stack"


def check_podmonitors(objs: list[Obj], release: str = PROMETHEUS_RELEASE) -> list[str]:
    """One PodMonitor per job the alert rules and the dashboard use, each on a real port, each
    with the label kube-prometheus-stack's podMonitorSelector matches."""
    problems = []
    jobs = []
    for pm in find(objs, "PodMonitor"):
        name = pm["metadata"]["name"]
        if pm["metadata"].get("labels", {}).get("release") != release:
            problems.append(f"PodMonitor {name} lacks release: {release}")
        chosen = [
            t
            for t in pod_templates(objs)
            if selects(pm["spec"]["selector"]["matchLabels"], t.labels)
        ]
        if not chosen:
            problems.append(f"PodMonitor {name} selects no pods")
        for ep in pm["spec"]["podMetricsEndpoints"]:
            for t in chosen:
                if ep.get("port") not in container_ports(t):
                    problems.append(f"PodMonitor {name}: port {ep.get('port')!r} not in {t.owner}")
            for r in ep.get("relabelings", []):
                if r.get("targetLabel") == "job":
                    jobs.append(r.get("replacement"))
    want = ["decode", "prefill"] + (["proxy"] if proxy_template(objs) else [])
    if sorted(jobs) != want:
        problems.append(f"PodMonitor jobs {sorted(jobs)}, want {want}")
    return problems


def alert_jobs() -> set[str]:
    text = ALERTS.read_text()
    return set(re.findall(r'job="([a-z]+)"', text)) | {
        j for group in re.findall(r'job=~"([^"]+)"', text) for j in group.split("|")
    }


def check_prometheus_config(objs: list[Obj]) -> list[str]:
    """The plain Prometheus: alerts.yml is compose's, every dns_sd name is the SRV record of a
    named port of a rendered headless Service that the selected pods have, and the jobs are the
    alert rules'."""
    problems = []
    cm = generated(objs, "ConfigMap", "pcp-pd-prometheus-config")
    data = cm.get("data", {})
    if data.get("alerts.yml") != ALERTS.read_text():
        problems.append("alerts.yml in the ConfigMap differs from compose/prometheus/alerts.yml")
    config = yaml.safe_load(data.get("prometheus.yml", "{}"))
    if config.get("rule_files") != ["alerts.yml"]:
        problems.append(f"rule_files {config.get('rule_files')}")
    services = {s["metadata"]["name"]: s for s in find(objs, "Service")}
    job_names = set()
    for job in config.get("scrape_configs", []):
        job_names.add(job["job_name"])
        for sd in job.get("dns_sd_configs", []):
            for dns in sd["names"]:
                problems += _srv_problems(job["job_name"], sd, dns, services, objs)
    if not alert_jobs() <= job_names:
        problems.append(f"jobs {sorted(job_names)} miss alert jobs {sorted(alert_jobs())}")
    return problems


def _srv_problems(
    job: str, sd: Obj, name: str, services: dict[str, Obj], objs: list[Obj]
) -> list[str]:
    """An SRV name _<port>._tcp.<service>: a headless Service with that named port, whose target
    is a container port of every pod it selects (the SRV answers carry those pod ports)."""
    match = re.fullmatch(r"_([a-z0-9-]+)\._tcp\.([a-z0-9-]+)", name)
    if sd.get("type") != "SRV" or match is None:
        return [f"job {job}: {name} is not an SRV name _<port>._tcp.<service> (port-independent)"]
    port, svc_name = match.groups()
    svc = services.get(svc_name)
    if svc is None and job == "proxy" and proxy_template(objs) is None:
        return []  # llm-d-router replaced pd-proxy: its job has nothing to find (documented)
    if svc is None or svc["spec"].get("clusterIP") != "None":
        return [f"job {job}: {svc_name} is no headless Service"]
    entry = next((p for p in svc["spec"].get("ports", []) if p.get("name") == port), None)
    if entry is None:
        return [f"job {job}: Service {svc_name} has no port named {port}"]
    target = entry.get("targetPort", entry["port"])
    problems = []
    for t in pod_templates(objs):
        if selects(svc["spec"]["selector"], t.labels):
            ports = container_ports(t)
            if (target not in ports) if isinstance(target, str) else (target not in ports.values()):
                problems.append(f"job {job}: target {target} of {svc_name} not in {t.owner}")
    return problems


def check_dashboards(objs: list[Obj], dashboards_dir: Path) -> list[str]:
    cm = generated(objs, "ConfigMap", "pcp-pd-grafana-dashboards")
    data = cm.get("data", {})
    files = {p.name: p.read_text() for p in sorted(dashboards_dir.glob("*.json"))}
    problems = [f"dashboard {n} missing from the ConfigMap" for n in sorted(set(files) - set(data))]
    problems += [f"ConfigMap key {n} is no dashboard file" for n in sorted(set(data) - set(files))]
    problems += [
        f"dashboard {n} differs" for n in sorted(set(files) & set(data)) if data[n] != files[n]
    ]
    if cm["metadata"].get("labels", {}).get("grafana_dashboard") != "1":
        problems.append("dashboard ConfigMap lacks the grafana_dashboard=1 sidecar label")
    return problems


# ----------------------------------------------------------------------------- transports


def ucx_tls(objs: list[Obj]) -> dict[str, set[str]]:
    out = {}
    for t in role_templates(objs, "prefill") + role_templates(objs, "decode"):
        env = container_env(t.container(VLLM_CONTAINER), objs, t.injected)
        out[t.owner] = set(env.get("UCX_TLS", "").split(","))
    return out


def check_transport_rdma(objs: list[Obj]) -> list[str]:
    problems = []
    for owner, tls in ucx_tls(objs).items():
        if not {"rc", "ud"} <= tls:
            problems.append(f"{owner}: UCX_TLS {sorted(tls)} lacks rc/ud")
    for t in role_templates(objs, "prefill") + role_templates(objs, "decode"):
        c = t.container(VLLM_CONTAINER)
        if "IPC_LOCK" not in c.get("securityContext", {}).get("capabilities", {}).get("add", []):
            problems.append(f"{t.owner}: no IPC_LOCK")
        resources = c.get("resources", {})
        extra = {
            k: v
            for k, v in resources.get("limits", {}).items()
            if k not in ("cpu", "memory", "ephemeral-storage", "nvidia.com/gpu")
            and not k.startswith("hugepages-")
        }
        if len(extra) != 1:
            problems.append(
                f"{t.owner}: {sorted(extra) or 'no'} RDMA device resource(s), want exactly one "
                "(your device plugin's; an overlay component adds it: overlays/xpyd/rdma-resource)"
            )
        for name, value in extra.items():
            if resources.get("requests", {}).get(name) != value:
                problems.append(f"{t.owner}: {name} requested != limit")
    return problems


def check_transport_tcp(objs: list[Obj]) -> list[str]:
    problems = []
    for owner, tls in ucx_tls(objs).items():
        if "tcp" not in tls or tls & {"rc", "ud", "dc", "ib", "rc_x", "ud_x", "dc_x", "cuda_ipc"}:
            problems.append(f"{owner}: UCX_TLS {sorted(tls)} is not TCP-only")
    return problems


# ----------------------------------------------------------------------------- LWS, router


def check_lws(objs: list[Obj]) -> list[str]:
    """One prefill instance per LWS group: the leader serves (role label, probes), the workers run
    headless with their node rank, --nnodes is the group size, and the LWS's own headless Service
    (named like the LWS) does not clash with ours."""
    problems = []
    services = {s["metadata"]["name"] for s in find(objs, "Service")}
    sets = find(objs, "LeaderWorkerSet")
    if not sets:
        return ["no LeaderWorkerSet"]
    if find(objs, "Deployment", "pcp-pd-prefill"):
        problems.append("the prefill Deployment is still rendered next to the LWS")
    for lws in sets:
        name = lws["metadata"]["name"]
        if name in services:
            problems.append(f"LWS {name}: a Service of that name exists (the controller makes one)")
        size = str(lws["spec"]["leaderWorkerTemplate"]["size"])
        for t in pod_templates([lws]):
            argv = vllm_argv(t, objs)
            _, flags = parse_flags(argv)
            if flags.get("--nnodes") != [size]:
                problems.append(f"{t.owner}: --nnodes {flags.get('--nnodes')} != size {size}")
            if flags.get("--node-rank") != [t.injected["LWS_WORKER_INDEX"]]:
                problems.append(f"{t.owner}: --node-rank {flags.get('--node-rank')}")
            headless = "--headless" in flags
            if headless != (t.role == "worker"):
                problems.append(f"{t.owner}: --headless {'set' if headless else 'missing'}")
            if (t.labels.get("llm-d.ai/role") == "prefill") != (t.role == "leader"):
                problems.append(f"{t.owner}: role label on the wrong pods")
    return problems


def check_router(objs: list[Obj], values: Mapping[str, Any]) -> list[str]:
    """llm-d's router: its InferencePool selects every prefill and decode pod, each answers on the
    pool's target port (prefill vLLM, decode sidecar), and the sidecar talks nixlv2 to the local
    vLLM's port."""
    problems = []
    router = values.get("router", {})
    match = router.get("modelServers", {}).get("matchLabels", {})
    targets = {p["number"] for p in router.get("modelServers", {}).get("targetPorts", [])}
    if find(objs, "Deployment", PROXY_DEPLOYMENT) or find(objs, "PodMonitor", PROXY_DEPLOYMENT):
        problems.append("pd-proxy (or its PodMonitor) is still deployed next to the router")
    for role in ("prefill", "decode"):
        for t in role_templates(objs, role):
            # A headless LWS worker has no HTTP server: it must stay out of the pool.
            if selects(match, t.labels) != (t.role != "worker"):
                problems.append(f"{t.owner}: router matchLabels {match} select it wrongly")
    for t in role_templates(objs, "prefill"):
        if t.role == "worker":
            continue
        port = flag(vllm_argv(t, objs), "--port")
        if port is None or int(port) not in targets:
            problems.append(f"{t.owner}: vLLM --port {port} is not a pool target {targets}")
    for t in role_templates(objs, "decode"):
        sidecars = [
            c for c in t.spec.get("initContainers", []) if c.get("restartPolicy") == "Always"
        ]
        if len(sidecars) != 1:
            problems.append(f"{t.owner}: {len(sidecars)} native sidecars, want the routing proxy")
            continue
        args = dict(a.lstrip("-").split("=", 1) for a in sidecars[0].get("args", []) if "=" in a)
        if args.get("kv-connector") != "nixlv2":
            problems.append(f"{t.owner}: sidecar kv-connector {args.get('kv-connector')}")
        if args.get("port") is None or int(args["port"]) not in targets:
            problems.append(f"{t.owner}: sidecar port {args.get('port')} not in {targets}")
        if args.get("vllm-port") != flag(vllm_argv(t, objs), "--port"):
            problems.append(f"{t.owner}: sidecar --vllm-port {args.get('vllm-port')} != vLLM port")
    return problems


# ----------------------------------------------------------------------------- compose parity

# Compose-only environment: GPU selection by host index and replica (the device plugin does it
# on Kubernetes, where each pod is one replica).
# (The side-channel host is the pod IP there; compose leaves it to the entrypoint, which uses the
# replica's own address.)
# Compose only: GPU slices of one host's GPUs and their slot leases (the pods get theirs from the
# scheduler and the device plugin).
COMPOSE_ONLY_ENV = {
    "KIT_ROLE_GPUS",
    "KIT_ALL_GPUS",
    "KIT_ROLE_REPLICAS",
    "KIT_SLOT_DIR",
    "KIT_GPU_FREE_HEADROOM_GIB",
    "KIT_KV_TRANSPORT_CHECK",  # the start probe runs with compose's slots (docs/gpu.md)
}
COMPOSE_ONLY_MOUNTS = {"/run/kit-slots"}
# pd-proxy: compose resolves the service names (every replica), Kubernetes watches the
# Services; compose sets the client key file only when secrets/api_keys is non-empty (its
# entrypoint), Kubernetes always (docs/kubernetes.md).
PROXY_COMPOSE_ONLY = {"PD_PROXY_PREFILL_DNS", "PD_PROXY_DECODE_DNS"}
PROXY_K8S_ONLY = {
    "PD_PROXY_PREFILL_K8S_SERVICE",
    "PD_PROXY_DECODE_K8S_SERVICE",
    "PD_PROXY_API_KEY_FILE",
}


def compose_argv(service: Mapping[str, Any]) -> list[str]:
    """What the compose service's container finally execs: entrypoint + command through the kit's
    entrypoint with the service's environment (ValueError where it would refuse)."""
    argv = [str(a) for a in [*(service.get("entrypoint") or []), *(service.get("command") or [])]]
    env = {k: "" if v is None else str(v) for k, v in (service.get("environment") or {}).items()}
    return effective_argv(argv, env)


def argv_differences(k8s: list[str], compose: list[str]) -> list[str]:
    """Differences between two vLLM command lines, flag by flag (order-insensitive)."""
    kpos, kflags = parse_flags(k8s)
    cpos, cflags = parse_flags(compose)
    problems = []
    if kpos != cpos:
        problems.append(f"program/positionals {kpos} != compose {cpos}")
    for name in sorted(set(kflags) | set(cflags)):
        if kflags.get(name) != cflags.get(name):
            problems.append(f"{name}: kubernetes {kflags.get(name)} != compose {cflags.get(name)}")
    return problems


def check_vllm_argv_parity(
    objs: list[Obj], compose: Mapping[str, Any], ignore: frozenset[str] = frozenset()
) -> list[str]:
    """The vLLM pods run exactly what the compose services run: the argv the kit's entrypoint
    execs in each (program, flags and the --kv-transfer-config it builds from the environment),
    apart from the flags in ``ignore`` (compared by a test of their own)."""
    problems = []
    for role in ("prefill", "decode"):
        templates = [t for t in role_templates(objs, role) if t.role == "pod"]
        if not templates:
            problems.append(f"no {role} Deployment to compare")
        try:
            want = compose_argv(compose["services"][role])
        except ValueError as exc:
            problems.append(f"compose {role}: the entrypoint refuses to start: {exc}")
            continue
        for t in templates:
            try:
                got = vllm_argv(t, objs)
            except ValueError as exc:
                problems.append(f"{t.owner}: the entrypoint refuses to start: {exc}")
                continue
            problems += [
                f"{t.owner}: {d}"
                for d in argv_differences(got, want)
                if d.split(":", 1)[0] not in ignore
            ]
    return problems


def check_vllm_env_parity(objs: list[Obj], compose: Mapping[str, Any]) -> list[str]:
    """Every environment variable compose gives a vLLM server, the pod has with the same value
    (apart from COMPOSE_ONLY_ENV)."""
    problems = []
    for role in ("prefill", "decode"):
        want = {
            k: str(v)
            for k, v in (compose["services"][role].get("environment") or {}).items()
            if k not in COMPOSE_ONLY_ENV
        }
        for t in role_templates(objs, role):
            env = container_env(t.container(VLLM_CONTAINER), objs, t.injected)
            for key, value in sorted(want.items()):
                if env.get(key) != value:
                    problems.append(f"{t.owner}: {key}={env.get(key)!r}, compose {value!r}")
    return problems


def compose_mount_targets(service: Mapping[str, Any]) -> set[str]:
    targets = {v["target"] for v in service.get("volumes") or []}
    targets |= {
        s.get("target") or f"/run/secrets/{s['source']}" for s in service.get("secrets") or []
    }
    return targets


def check_mount_parity(objs: list[Obj], compose: Mapping[str, Any]) -> list[str]:
    """Every path compose mounts into a container (volumes, secrets) is mounted in the pod too,
    at that path or inside it (the connector package folder)."""
    problems = []
    pairs: list[tuple[str, PodTemplate, Obj]] = []
    for role in ("prefill", "decode"):
        pairs += [(role, t, t.container(VLLM_CONTAINER)) for t in role_templates(objs, role)]
    proxy = proxy_template(objs)
    if proxy is not None:
        pairs.append(("proxy", proxy, proxy.spec["containers"][0]))
    for service, t, container in pairs:
        paths = set(mounts(container))
        for target in sorted(
            compose_mount_targets(compose["services"][service]) - COMPOSE_ONLY_MOUNTS
        ):
            if not any(p == target or p.startswith(target + "/") for p in paths):
                problems.append(f"{t.owner}: compose mounts {target}, the pod does not")
    return problems


def check_proxy_env_parity(objs: list[Obj], compose: Mapping[str, Any]) -> list[str]:
    problems = []
    t = proxy_template(objs)
    if t is None:
        return ["no pd-proxy Deployment"]
    env = container_env(t.spec["containers"][0], objs, t.injected)
    want = {k: str(v) for k, v in (compose["services"]["proxy"].get("environment") or {}).items()}
    for key in sorted(set(want) - PROXY_COMPOSE_ONLY):
        if env.get(key) != want[key]:
            problems.append(f"pd-proxy {key}={env.get(key)!r}, compose {want[key]!r}")
    extra = set(env) - set(want) - PROXY_K8S_ONLY
    if extra:
        problems.append(f"pd-proxy variables compose does not set: {sorted(extra)}")
    entry = " ".join(compose["services"]["proxy"].get("entrypoint") or [])
    for path in re.findall(r"PD_PROXY_API_KEY_FILE=(\S+?);", entry):
        if env.get("PD_PROXY_API_KEY_FILE") != path:
            problems.append(f"client key file {env.get('PD_PROXY_API_KEY_FILE')} != compose {path}")
    return problems


def check_image_parity(objs: list[Obj], compose: Mapping[str, Any]) -> list[str]:
    problems = []
    services = compose["services"]
    for role in ("prefill", "decode"):
        for t in role_templates(objs, role):
            image = t.container(VLLM_CONTAINER)["image"]
            if image != services[role]["image"]:
                problems.append(f"{t.owner}: image {image} != compose {services[role]['image']}")
    proxy = proxy_template(objs)
    if proxy is not None:
        # An overlay puts it in the operator's registry: same repository path and tag.
        image, want = proxy.spec["containers"][0]["image"], services["proxy"]["image"]
        if image != want and not image.endswith("/" + want):
            problems.append(f"pd-proxy image {image} is not compose's {want} (in some registry)")
    for o in find(objs, "Deployment", "pcp-pd-prometheus"):
        c = o["spec"]["template"]["spec"]["containers"][0]
        base = (services["prometheus"].get("build") or {}).get("args", {}).get("BASE_IMAGE")
        if c["image"] != base:
            problems.append(f"Prometheus image {c['image']} != compose's base {base}")
        want = services["prometheus"].get("command")
        if c.get("args") != want:
            problems.append(f"Prometheus args {c.get('args')} != compose {want}")
    return problems


def check_resource_parity(objs: list[Obj], compose: Mapping[str, Any]) -> list[str]:
    """/dev/shm = compose's shm_size; the startup window covers compose's start_period."""
    problems = []
    for role in ("prefill", "decode"):
        service = compose["services"][role]
        shm = int(service.get("shm_size", 0))
        problems += check_shm(objs, shm) if shm else [f"compose {role}: no shm_size"]
        start = duration_seconds(service.get("healthcheck", {}).get("start_period", "0s"))
        problems += [p for p in check_vllm_http(objs, start) if "startup window" in p]
    return sorted(set(problems))
