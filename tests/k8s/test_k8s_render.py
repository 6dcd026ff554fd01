"""Every overlay and component set renders, and every object validates: core kinds with
kubernetes-validate (strict, pinned Kubernetes version), custom resources with our schemas."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import yaml

from tests.k8s.manifests import (
    BASE,
    DEPLOY,
    KUBERNETES_VERSION,
    SCHEMAS,
    RenderError,
    components,
    find,
    kustomize,
    overlays,
)
from tests.k8s.renders import ALL_RENDERS, COMBOS, needs_kubectl, rendered

pytestmark = needs_kubectl

kv = pytest.importorskip(
    "kubernetes_validate",
    reason="kubernetes-validate is not installed (pip install kubernetes-validate==1.37.0)",
)

CUSTOM_SCHEMAS = {
    ("monitoring.coreos.com/v1", "PodMonitor"): SCHEMAS / "podmonitor.schema.json",
    ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"): SCHEMAS / "leaderworkerset.schema.json",
}


def validation_problems(obj: dict) -> list[str]:
    """Schema problems of one rendered object (empty = valid)."""
    key = (obj.get("apiVersion"), obj.get("kind"))
    name = f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"
    if key in CUSTOM_SCHEMAS:
        schema = json.loads(CUSTOM_SCHEMAS[key].read_text())
        validator = jsonschema.Draft202012Validator(schema)
        problems = [
            f"{name}: {'/'.join(map(str, e.absolute_path))}: {e.message}"
            for e in validator.iter_errors(obj)
        ]
        if obj.get("kind") == "LeaderWorkerSet" and not problems:
            lwt = obj["spec"]["leaderWorkerTemplate"]
            for part in ("leaderTemplate", "workerTemplate"):
                if part in lwt:
                    wrapped = {
                        "apiVersion": "v1",
                        "kind": "PodTemplate",
                        "metadata": {"name": f"{obj['metadata']['name']}-{part.lower()}"},
                        "template": lwt[part],
                    }
                    problems += [f"{name} {part}: {p}" for p in validation_problems(wrapped)]
        return problems
    try:
        kv.validate(obj, KUBERNETES_VERSION, strict=True)
    except kv.SchemaNotFoundError:
        return [f"{name}: no schema for {key} (add one under tests/k8s/schemas)"]
    except kv.ValidationError as exc:  # a jsonschema.ValidationError
        return [f"{name}: {'/'.join(map(str, exc.absolute_path))}: {exc.message}"]
    return []


def test_there_are_overlays_1p1d_and_xpyd() -> None:
    assert {p.name for p in overlays()} >= {"1p1d", "xpyd"}


def test_combos_use_every_component() -> None:
    used = {c for combo in COMBOS.values() for c in combo}
    base = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    used |= {c.rsplit("/", 1)[1] for c in base.get("components", [])}  # in every render
    assert "network-policy" in used
    assert {p.name for p in components()} - {"copy-pod-spec"} <= used


@pytest.mark.parametrize("name", ALL_RENDERS)
def test_renders(name: str) -> None:
    objs = rendered(name)
    kinds = {o["kind"] for o in objs}
    assert {"ConfigMap", "Service"} <= kinds
    assert find(objs, "Deployment") or find(objs, "LeaderWorkerSet")
    names = [(o["kind"], o["metadata"]["name"]) for o in objs]
    assert len(names) == len(set(names)), "duplicate objects"


@pytest.mark.parametrize("name", ALL_RENDERS)
def test_objects_validate(name: str) -> None:
    problems = [p for o in rendered(name) for p in validation_problems(o)]
    assert problems == []


def test_overlay_shapes() -> None:
    one = rendered("overlay:1p1d")
    assert [d["spec"].get("replicas", 1) for d in find(one, "Deployment", "pcp-pd-prefill")] == [1]
    assert [d["spec"].get("replicas", 1) for d in find(one, "Deployment", "pcp-pd-decode")] == [1]
    many = rendered("overlay:xpyd")
    assert find(many, "Deployment", "pcp-pd-prefill")[0]["spec"]["replicas"] == 2
    assert find(many, "Deployment", "pcp-pd-decode")[0]["spec"]["replicas"] == 2
    assert find(many, "Deployment", "pcp-pd-proxy")[0]["spec"]["replicas"] == 2


def test_xpyd_with_lws_keeps_two_prefill_instances() -> None:
    """The overlay's comment says: append lws-prefill. It renders, and the Deployment's 2
    replicas become 2 LWS groups (not 1)."""
    objs = rendered("xpyd+lws")
    assert not find(objs, "Deployment", "pcp-pd-prefill")
    assert [o["spec"]["replicas"] for o in find(objs, "LeaderWorkerSet")] == [2]
    assert find(objs, "Deployment", "pcp-pd-decode")[0]["spec"]["replicas"] == 2


def test_renders_use_kustomize_default_load_restrictions(tmp_path: Path) -> None:
    """Every render here is what `kubectl apply -k` does (no --load-restrictor flag), and that
    restrictor is on: a kustomization reading a file outside its folder is refused."""
    for path in DEPLOY.rglob("kustomization.yaml"):
        assert "LoadRestrictionsNone" not in path.read_text(), path
    (tmp_path / "outside.txt").write_text("x")
    inner = tmp_path / "k"
    inner.mkdir()
    (inner / "kustomization.yaml").write_text(
        "configMapGenerator:\n  - name: x\n    files:\n      - ../outside.txt\n"
    )
    with pytest.raises(RenderError, match="not in or below"):
        kustomize(inner)


# ------------------------------------------------------------------ the validators can fail


def test_strict_validation_rejects_an_unknown_field() -> None:
    svc = next(o for o in rendered("base") if o["kind"] == "Service")
    svc["spec"]["selectr"] = {"a": "b"}
    assert validation_problems(svc)


def test_validation_rejects_a_wrong_type() -> None:
    dep = find(rendered("base"), "Deployment", "pcp-pd-decode")[0]
    dep["spec"]["replicas"] = "two"
    assert validation_problems(dep)


def test_podmonitor_schema_rejects_a_typo() -> None:
    pm = find(rendered("monitoring"), "PodMonitor")[0]
    pm["spec"]["podMetricsEndpoints"][0]["intervall"] = "15s"
    assert validation_problems(pm)


def test_lws_schema_rejects_a_bad_pod_template() -> None:
    lws = find(rendered("lws"), "LeaderWorkerSet")[0]
    lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]["imag"] = "x"
    assert validation_problems(lws)


def test_unknown_kind_without_schema_is_a_problem() -> None:
    obj = {"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w"}}
    assert validation_problems(obj)


def test_component_files_are_all_yaml_documents() -> None:
    import yaml

    for path in sorted(Path(BASE).parent.rglob("*.yaml")):
        list(yaml.safe_load_all(path.read_text()))
