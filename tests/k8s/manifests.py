"""Rendering and reading the Kubernetes manifests for tests/k8s.

Everything here is offline: `kubectl kustomize` renders, a kubelet-like expansion resolves the
containers' environment and `$(VAR)` references, and the container's shell command runs with a stub
in place of the real program to capture the argv it would exec.
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml

from pcp_pd_kit.settings import read_env_file
from tests.support.paths import ENV_EXAMPLE, REPO

DEPLOY = REPO / "deploy" / "k8s"
BASE = DEPLOY / "base"
COMPONENTS_DIR = DEPLOY / "components"
OVERLAYS_DIR = DEPLOY / "overlays"
CONNECTOR_PKG = REPO / "connector" / "pcp_nixl_connector"
ENTRYPOINT = REPO / "compose" / "entrypoint" / "vllm_serve"  # the package the pods run
DASHBOARDS = REPO / "compose" / "grafana" / "dashboards"
ALERTS = REPO / "compose" / "prometheus" / "alerts.yml"
SCHEMAS = Path(__file__).resolve().parent / "schemas"

# The Kubernetes version the manifests are validated against (kubernetes-validate's schemas).
KUBERNETES_VERSION = "1.32.0"
# Rendered exactly as `kubectl apply -k` does: kustomize's default load restrictions (no file
# outside a kustomization's folder), which is why deploy/k8s carries generated copies.
COMPOSE_PLUGIN = Path("/usr/local/lib/docker/cli-plugins/docker-compose")

Obj = dict[str, Any]


def overlays() -> list[Path]:
    return sorted(p.parent for p in OVERLAYS_DIR.glob("*/kustomization.yaml"))


def components() -> list[Path]:
    return sorted(p.parent for p in COMPONENTS_DIR.glob("*/kustomization.yaml"))


def kubectl() -> str | None:
    """$KUBECTL, else kubectl on PATH; None when neither is an executable."""
    return shutil.which(os.environ.get("KUBECTL") or "kubectl")


class RenderError(RuntimeError):
    """`kubectl kustomize` failed; the message carries its stderr."""


def kustomize(path: Path) -> str:
    """`kubectl kustomize` of ``path`` as text, with kustomize's default load restrictions."""
    exe = kubectl()
    if exe is None:
        raise RenderError("kubectl not found")
    proc = subprocess.run(
        [exe, "kustomize", str(path)], capture_output=True, text=True, timeout=120
    )
    if proc.returncode != 0:
        raise RenderError(f"kubectl kustomize {path} failed:\n{proc.stderr.strip()}")
    return proc.stdout


@functools.cache
def _render_text(path: str) -> str:
    return kustomize(Path(path))


def render(path: Path) -> list[Obj]:
    """The objects of a kustomization (fresh copies: callers may mutate them)."""
    return [doc for doc in yaml.safe_load_all(_render_text(str(path))) if doc]


_SCRATCH = Path(tempfile.mkdtemp(prefix="pcp-pd-k8s-"))
atexit.register(shutil.rmtree, _SCRATCH, ignore_errors=True)


def component_dir(name: str) -> Path:
    """deploy/k8s/components/<name>, or a component elsewhere in deploy/k8s by its path there
    (an overlay's own, e.g. overlays/xpyd/rdma-resource)."""
    return DEPLOY / name if "/" in name else COMPONENTS_DIR / name


@functools.cache
def _composed_dir(names: tuple[str, ...], images: str = "", patches: str = "") -> str:
    """A throwaway overlay: the base plus the named components, in order (and ``images`` and
    ``patches``, YAML lists for kustomize's fields of those names)."""
    slug = "+".join(n.replace("/", "_") for n in names) or "only"
    digest = hashlib.sha1((images + patches).encode()).hexdigest()[:8]
    folder = _SCRATCH / f"base+{slug}+{digest}"
    folder.mkdir(parents=True, exist_ok=True)
    doc: Obj = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [os.path.relpath(BASE, folder)],
        "components": [os.path.relpath(component_dir(n), folder) for n in names],
    }
    if images:
        doc["images"] = yaml.safe_load(images)
    if patches:
        doc["patches"] = yaml.safe_load(patches)
    (folder / "kustomization.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    return str(folder)


def render_with(*names: str) -> list[Obj]:
    """The base with the named components (see ``component_dir``), as an overlay would."""
    return render(Path(_composed_dir(tuple(names))))


def overlay_components(overlay: str) -> tuple[list[str], list[Obj]]:
    """An overlay's components (as ``component_dir`` names) and its images field."""
    folder = OVERLAYS_DIR / overlay
    doc = yaml.safe_load((folder / "kustomization.yaml").read_text())
    names = [str((folder / c).resolve().relative_to(DEPLOY)) for c in doc.get("components", [])]
    names = [n.removeprefix("components/") for n in names]
    return names, doc.get("images", [])


def render_overlay_plus(
    overlay: str, *extra: str, images: str | None = None, patches: str = ""
) -> list[Obj]:
    """An overlay with more components appended, as its comment tells operators to do (and
    optionally other images and extra patches, as an operator's copy of it would have)."""
    names, own_images = overlay_components(overlay)
    chosen = images if images is not None else yaml.safe_dump(own_images)
    return render(Path(_composed_dir((*names, *extra), chosen, patches)))


# ----------------------------------------------------------------------------- objects


def find(objs: list[Obj], kind: str, name: str | None = None) -> list[Obj]:
    return [
        o for o in objs if o.get("kind") == kind and (name is None or o["metadata"]["name"] == name)
    ]


def one(objs: list[Obj], kind: str, name: str) -> Obj:
    found = find(objs, kind, name)
    assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
    return found[0]


def generated(objs: list[Obj], kind: str, base_name: str) -> Obj:
    """A generated ConfigMap/Secret by its name before kustomize's hash suffix."""
    pattern = re.compile(re.escape(base_name) + r"(-[a-z0-9]{10})?$")
    found = [o for o in find(objs, kind) if pattern.fullmatch(o["metadata"]["name"])]
    assert len(found) == 1, f"expected one generated {kind} {base_name}, found {len(found)}"
    return found[0]


class PodTemplate:
    """A pod template with where it came from and the environment its controller injects."""

    def __init__(self, owner: str, template: Obj, injected: Mapping[str, str], role: str) -> None:
        self.owner = owner
        self.template = template
        self.injected = dict(injected)
        self.role = role  # "pod" (Deployment), "leader" or "worker" (LeaderWorkerSet)

    @property
    def labels(self) -> dict[str, str]:
        return dict(self.template.get("metadata", {}).get("labels", {}))

    @property
    def spec(self) -> Obj:
        return self.template["spec"]

    def container(self, name: str) -> Obj:
        for c in self.spec.get("containers", []):
            if c["name"] == name:
                return c
        raise KeyError(f"{self.owner}: no container {name!r}")

    def __repr__(self) -> str:
        return f"PodTemplate({self.owner})"


def pod_templates(objs: list[Obj]) -> list[PodTemplate]:
    out = []
    for o in objs:
        name = o["metadata"]["name"]
        if o.get("kind") == "Deployment":
            out.append(PodTemplate(f"Deployment/{name}", o["spec"]["template"], {}, "pod"))
        elif o.get("kind") == "LeaderWorkerSet":
            lwt = o["spec"]["leaderWorkerTemplate"]
            size = str(lwt.get("size", 1))
            common = {"LWS_LEADER_ADDRESS": f"{name}-0.{name}", "LWS_GROUP_SIZE": size}
            if "leaderTemplate" in lwt:
                env = {**common, "LWS_WORKER_INDEX": "0"}
                out.append(
                    PodTemplate(
                        f"LeaderWorkerSet/{name}/leader", lwt["leaderTemplate"], env, "leader"
                    )
                )
            env = {**common, "LWS_WORKER_INDEX": "1"}
            out.append(
                PodTemplate(f"LeaderWorkerSet/{name}/worker", lwt["workerTemplate"], env, "worker")
            )
    return out


def role_templates(objs: list[Obj], role: str) -> list[PodTemplate]:
    """Pod templates whose pods carry llm-d.ai/role=<role> or belong to that role's LWS."""
    return [
        t
        for t in pod_templates(objs)
        if t.labels.get("llm-d.ai/role") == role
        or t.labels.get("app.kubernetes.io/component") == f"{role}-worker"
    ]


def selects(selector: Mapping[str, str], labels: Mapping[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


# ----------------------------------------------------------------------------- kubelet emulation

_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand(text: str, env: Mapping[str, str]) -> str:
    """The kubelet's `$(VAR)` expansion: defined names are replaced, `$$` is a literal `$`,
    undefined references stay as written."""

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))

    return _VAR.sub(sub, text)


class EnvError(ValueError):
    """A container's environment cannot be built (missing ConfigMap, key, ...)."""


POD_IP = "10.244.1.23"


def container_env(
    container: Obj, objs: list[Obj], injected: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The environment the kubelet would give ``container``: controller-injected variables,
    envFrom, then env in order with `$(VAR)` expansion. Secrets are not rendered (they are created
    by hand), so secret values are placeholders."""
    env: dict[str, str] = dict(injected or {})
    configmaps = {o["metadata"]["name"]: o.get("data", {}) for o in find(objs, "ConfigMap")}
    for source in container.get("envFrom", []):
        prefix = source.get("prefix", "")
        if "configMapRef" in source:
            name = source["configMapRef"]["name"]
            if name not in configmaps:
                if source["configMapRef"].get("optional"):
                    continue
                raise EnvError(f"envFrom ConfigMap {name!r} is not rendered")
            for key, value in configmaps[name].items():
                env[prefix + key] = str(value)
        elif "secretRef" in source:
            continue  # hand-made Secret: contents unknown offline
    for item in container.get("env", []):
        name = item["name"]
        if "value" in item:
            env[name] = expand(str(item["value"]), env)
            continue
        ref = item.get("valueFrom", {})
        if "configMapKeyRef" in ref:
            cm, key = ref["configMapKeyRef"]["name"], ref["configMapKeyRef"]["key"]
            if cm not in configmaps or key not in configmaps[cm]:
                if ref["configMapKeyRef"].get("optional"):
                    continue
                raise EnvError(f"env {name}: ConfigMap {cm!r} key {key!r} is not rendered")
            env[name] = str(configmaps[cm][key])
        elif "secretKeyRef" in ref:
            secret = ref["secretKeyRef"]
            env[name] = f"<secret {secret['name']}/{secret['key']}>"
        elif "fieldRef" in ref:
            path = ref["fieldRef"]["fieldPath"]
            env[name] = {"status.podIP": POD_IP}.get(path, f"<field {path}>")
        elif "resourceFieldRef" in ref:
            env[name] = f"<resource {ref['resourceFieldRef']['resource']}>"
        else:
            raise EnvError(f"env {name}: no value")
    return env


_STUB = '#!/bin/sh\nprintf \'%s\\0\' "${0##*/}" "$@" > "$KIT_TEST_ARGV_OUT"\n'


def exec_argv(container: Obj, env: Mapping[str, str], programs: tuple[str, ...]) -> list[str]:
    """The argv the container's process would exec: command + args after `$(VAR)` expansion; a
    `sh -c` command is run for real with stubs named ``programs`` first on PATH, which record the
    argv they are started with (the first element is the program's name)."""
    argv = [expand(a, env) for a in [*container.get("command", []), *container.get("args", [])]]
    if len(argv) < 3 or argv[0] not in ("/bin/sh", "sh") or argv[1] != "-c":
        return argv
    with tempfile.TemporaryDirectory(prefix="pcp-pd-stub-") as tmp:
        for program in programs:
            stub = Path(tmp) / program
            stub.write_text(_STUB)
            stub.chmod(0o755)
        out = Path(tmp) / "argv"
        run_env = {**env, "PATH": tmp, "KIT_TEST_ARGV_OUT": str(out)}
        proc = subprocess.run(
            ["/bin/sh", "-c", *argv[2:]], env=run_env, capture_output=True, text=True, timeout=30
        )
        if proc.returncode != 0 or not out.exists():
            raise RuntimeError(
                f"container command did not exec a stub ({programs}): rc={proc.returncode} "
                f"stderr={proc.stderr.strip()!r}"
            )
        return out.read_bytes().decode().split("\0")[:-1]


def parse_flags(argv: list[str]) -> tuple[list[str], dict[str, list[str | None]]]:
    """(positionals, {--flag: [values]}) of a vLLM-style argv; a JSON value is normalised."""
    positionals: list[str] = []
    flags: dict[str, list[str | None]] = {}
    i = 0
    while i < len(argv):
        token = argv[i]
        if token.startswith("--"):
            name, eq, value = token.partition("=")
            if not eq:
                if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                    value = argv[i + 1]
                    i += 1
                else:
                    value = None
            if value is not None and value.lstrip().startswith("{"):
                value = json.dumps(json.loads(value), sort_keys=True)
            flags.setdefault(name, []).append(value)
        else:
            positionals.append(token)
        i += 1
    return positionals, flags


# ----------------------------------------------------------------------------- compose


def compose_file() -> Path | None:
    candidate = REPO / "compose.yaml"
    return candidate if candidate.exists() else None


def compose_command() -> list[str] | None:
    """The real Compose binary: the CLI plugin, a standalone docker-compose, or `docker compose`."""
    if COMPOSE_PLUGIN.exists():
        return [str(COMPOSE_PLUGIN)]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    docker = shutil.which("docker")
    if (
        docker
        and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0
    ):
        return [docker, "compose"]
    return None


@functools.lru_cache(maxsize=1)
def compose_model() -> Obj:
    """`docker compose config --format json` of the GPU deployment with .env.example's values,
    in a clean environment (no .env, no shell variables)."""
    return compose_model_with(())


def compose_model_with(overrides: tuple[tuple[str, str], ...]) -> Obj:
    """compose_model() with ``overrides`` set as shell variables (which win over the env file)."""
    exe, path = compose_command(), compose_file()
    assert exe is not None and path is not None
    argv = [*exe, "-f", str(path), "--env-file", str(ENV_EXAMPLE), "--profile", "gpu"]
    with tempfile.TemporaryDirectory(prefix="pcp-pd-compose-home-") as home:
        proc = subprocess.run(
            [*argv, "config", "--format", "json"],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=REPO,
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": home, **dict(overrides)},
        )
    if proc.returncode != 0:
        raise RuntimeError(f"docker compose config failed: {proc.stderr.strip()}")
    return json.loads(proc.stdout)


def env_example() -> dict[str, str]:
    """.env.example through the kit's one env-file reader."""
    return read_env_file(ENV_EXAMPLE)


def params_file(path: Path) -> dict[str, str]:
    """A kustomize env file: KEY=VALUE lines taken literally (kustomize keeps quotes)."""
    out = {}
    for line in path.read_text().splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        key, _, value = line.partition("=")
        out[key.strip()] = value
    return out


def walk_containers(template: PodTemplate) -> Iterator[Obj]:
    spec = template.spec
    yield from spec.get("initContainers", [])
    yield from spec.get("containers", [])
