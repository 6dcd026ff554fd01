"""`make k8s-check`: render a deploy/k8s overlay as `kubectl apply -k` does and refuse what would
only fail on the cluster, later and without saying why:

- an image still in the kit's placeholder registry (the overlays ship one, since no registry
  serves pd-proxy): the pods would sit in ImagePullBackOff;
- a vLLM pod whose side-channel port (``VLLM_NIXL_SIDE_CHANNEL_PORT``, read from pcp-pd-params
  at start) is not its ``nixl-side`` container port, which the NetworkPolicies admit by name: the
  NIXL handshake would time out;
- an ``hf-cache`` size or ephemeral-storage request that is not the params' ``HF_CACHE_SIZE``.

The last two happen when an overlay merges those params without listing components/params, which
copies them into those fields. ``--render`` prints the checked objects for
``kubectl apply -f -``, so checking and applying are one step. Needs kubectl (no cluster).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import yaml

# What the kit's overlays name until the operator sets their own registry (docs/kubernetes.md).
PLACEHOLDER_REGISTRY = "registry.example.com"
PUSH_HINT = (
    "build and push it (make k8s-proxy-image REGISTRY=<your registry>) and name that image in "
    "your overlay's `images:` (docs/kubernetes.md, checklist)"
)
PARAMS_HINT = "list ../../components/params in the overlay that sets it (docs/kubernetes.md)"

Obj = dict[str, Any]
_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


class RenderError(RuntimeError):
    """kubectl is missing or `kubectl kustomize` failed; the message says which and why."""


def render(path: Path, kubectl: str | None = None) -> str:
    """`kubectl kustomize path` (kustomize's default load restrictions, as `apply -k`)."""
    exe = shutil.which(kubectl or os.environ.get("KUBECTL") or "kubectl")
    if exe is None:
        raise RenderError("kubectl not found (set KUBECTL=/path/to/kubectl)")
    proc = subprocess.run(
        [exe, "kustomize", str(path)], capture_output=True, text=True, timeout=120, check=False
    )
    if proc.returncode != 0:
        raise RenderError(f"kubectl kustomize {path} failed:\n{proc.stderr.strip()}")
    return proc.stdout


def pod_specs(obj: Obj) -> Iterator[tuple[str, Obj]]:
    """(where, pod spec) of every pod template in ``obj``: workloads and LeaderWorkerSets."""
    kind, name = obj.get("kind"), (obj.get("metadata") or {}).get("name")
    spec = obj.get("spec") or {}
    template = spec.get("template") or (spec.get("jobTemplate") or {}).get("spec", {}).get(
        "template"
    )
    if isinstance(template, dict) and isinstance(template.get("spec"), dict):
        yield f"{kind}/{name}", template["spec"]
    lwt = spec.get("leaderWorkerTemplate") or {}
    for part in ("leaderTemplate", "workerTemplate"):
        if isinstance((lwt.get(part) or {}).get("spec"), dict):
            yield f"{kind}/{name} ({part})", lwt[part]["spec"]


def containers(spec: Obj) -> list[Obj]:
    return [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]


def placeholder_images(objs: list[Obj]) -> list[str]:
    problems = []
    for obj in objs:
        for where, spec in pod_specs(obj):
            for c in containers(spec):
                image = str(c.get("image", ""))
                line = (
                    f"{where}: image {image} is the kit's placeholder, which no registry "
                    f"serves (the pod would stay in ImagePullBackOff): {PUSH_HINT}"
                )
                # Once per pod and image (pd-proxy's init container runs its image too).
                if image.split("/", 1)[0] == PLACEHOLDER_REGISTRY and line not in problems:
                    problems.append(line)
    return problems


def _params(container: Obj, configmaps: dict[str, Obj]) -> tuple[dict[str, str], dict[str, str]]:
    """(the environment envFrom gives the container, env name -> the param key it came from)."""
    env: dict[str, str] = {}
    origin: dict[str, str] = {}
    for source in container.get("envFrom") or []:
        ref = source.get("configMapRef") or {}
        data = (configmaps.get(ref.get("name", "")) or {}).get("data") or {}
        for key, value in data.items():
            env[source.get("prefix", "") + key] = str(value)
            origin[source.get("prefix", "") + key] = key
    return env, origin


def _env_value(container: Obj, name: str, env: dict[str, str]) -> tuple[str | None, str | None]:
    """(the value of env ``name``, the variable it was expanded from, if one)."""
    for item in container.get("env") or []:
        if item.get("name") == name and "value" in item:
            text = str(item["value"])
            refs = _REF.findall(text)
            return _REF.sub(lambda m: env.get(m.group(1), m.group(0)), text), (
                refs[0] if refs else None
            )
    return None, None


def params_copies(objs: list[Obj]) -> list[str]:
    """Each pod's nixl-side port and hf-cache size equal the params its containers read."""
    configmaps = {o["metadata"]["name"]: o for o in objs if o.get("kind") == "ConfigMap"}
    problems = []
    for obj in objs:
        for where, spec in pod_specs(obj):
            volumes = {v.get("name"): v for v in spec.get("volumes") or []}
            for c in containers(spec):
                env, origin = _params(c, configmaps)
                port, var = _env_value(c, "VLLM_NIXL_SIDE_CHANNEL_PORT", env)
                declared = {p.get("name"): p.get("containerPort") for p in c.get("ports") or []}
                if port is not None and str(declared.get("nixl-side")) != port:
                    key = origin.get(var or "", var)
                    problems.append(
                        f"{where}: the side channel listens on {port} ({key}) but the nixl-side "
                        f"container port, which the NetworkPolicies admit, is "
                        f"{declared.get('nixl-side')}: {PARAMS_HINT}"
                    )
                size = next((v for k, v in env.items() if origin[k] == "HF_CACHE_SIZE"), None)
                cache = (volumes.get("hf-cache") or {}).get("emptyDir")
                if size is None or not isinstance(cache, dict):
                    continue
                request = ((c.get("resources") or {}).get("requests") or {}).get(
                    "ephemeral-storage"
                )
                for field, value in (("sizeLimit", cache.get("sizeLimit")), ("request", request)):
                    if str(value) != size:
                        problems.append(
                            f"{where}: hf-cache {field} {value} is not HF_CACHE_SIZE {size}: "
                            f"{PARAMS_HINT}"
                        )
    return problems


def problems(objs: list[Obj]) -> list[str]:
    return placeholder_images(objs) + params_copies(objs)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="k8s-check", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("kustomization", type=Path, help="e.g. deploy/k8s/overlays/1p1d")
    parser.add_argument(
        "--render", action="store_true", help="print the checked objects (for kubectl apply -f -)"
    )
    args = parser.parse_args(argv)
    try:
        text = render(args.kustomization)
    except RenderError as exc:
        print(f"k8s-check: {exc}", file=sys.stderr)
        return 2
    found = problems([doc for doc in yaml.safe_load_all(text) if doc])
    for problem in found:
        print(f"k8s-check: ERROR: {problem}", file=sys.stderr)
    if found:
        return 1
    if args.render:
        sys.stdout.write(text)
    else:
        print(f"k8s-check: {args.kustomization}: ok", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
