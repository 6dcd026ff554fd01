"""docs/kubernetes.md describes what is there: every overlay and component, the Secrets the
manifests expect, the render flag, and the router versions that are actually pinned."""

from __future__ import annotations

import re
import textwrap

import yaml

from pcp_pd_kit import k8s_check as kc
from tests.k8s import checks as ck
from tests.k8s import operations as op
from tests.k8s.manifests import (
    COMPONENTS_DIR,
    DEPLOY,
    REPO,
    components,
    find,
    overlays,
    params_file,
    render_overlay_plus,
    role_templates,
)
from tests.k8s.renders import needs_kubectl, rendered

DOC = REPO / "docs" / "kubernetes.md"


def doc() -> str:
    return DOC.read_text()


def test_every_overlay_and_component_is_documented() -> None:
    text = doc()
    missing = [p.name for p in [*overlays(), *components()] if f"{p.name}/" not in text]
    assert missing == []
    for name in ("rdma-resource/", "topology/"):
        assert name in text


def test_expected_secrets_and_keys_are_documented() -> None:
    text = doc()
    for secret in ck.EXPECTED_SECRETS:
        assert f"create secret generic {secret}" in text
    for key in ("vllm_api_key", "api_keys", "hf_token"):
        assert key in text


def test_docs_deploy_with_plain_apply_k() -> None:
    """`kubectl apply -k` works, so no document asks for the load-restrictor flag any more."""
    texts = {path: path.read_text() for path in (DOC, REPO / "README.md", DEPLOY / "README.md")}
    for path, text in texts.items():
        assert "LoadRestrictionsNone" not in text, path
        assert "kubectl apply -k deploy/k8s/overlays/" in text, path
    assert "make k8s-sources" in doc()


def test_operator_checklist_names_every_input() -> None:
    text = doc()
    checklist = text[text.index("## Operator checklist") : text.index("## Secrets")]
    for item in (
        "**Namespace.**",
        "**Secrets**",
        "**Image registry.**",
        "**RDMA resource name**",
        "**Model cache.**",
        "**kube-prometheus-stack**",
        "**Router release name**",
    ):
        assert f"- [ ] {item}" in checklist, item
    assert ck.PROMETHEUS_RELEASE in checklist
    versions = params_file(COMPONENTS_DIR / "llm-d-router" / "versions.env")
    assert f"`{versions['ROUTER_RELEASE']}`" in checklist
    assert f"helm install {versions['ROUTER_RELEASE']} " in text


def test_stale_statements_are_gone() -> None:
    text = doc()
    assert "not implemented" not in text and "implemented in pd-proxy separately" not in text
    assert "PD_PROXY_PREFILL_DNS" not in text  # pd-proxy watches the API on Kubernetes
    services = (DEPLOY / "base" / "services.yaml").read_text()
    assert "_DNS" not in services and "EndpointSlices" in services
    assert "rdma/ib" not in text
    lws = text[text.index("With `lws-prefill`") : text.index("**One copy of the code")]
    assert "leaderworkerset/pcp-pd-prefill-lws" in lws
    assert "deploy/pcp-pd-prefill" not in lws


@needs_kubectl
def test_documented_timings_are_the_manifests() -> None:
    timings = op.timings(rendered("base"))
    text = " ".join(doc().split())  # line breaks do not matter
    assert f"`preStop` sleeps {timings['prestop_s']} s" in text
    assert f"`--shutdown-timeout {timings['shutdown_timeout_s']}`" in text
    assert f"`terminationGracePeriodSeconds: {timings['grace_s']}`" in text
    assert f"stop_grace_period: {timings['grace_s'] - timings['prestop_s']}s" in text


def yaml_blocks(text: str, needle: str) -> list[dict]:
    """The ```yaml blocks of ``text`` that contain ``needle``, parsed (list indentation off)."""
    blocks = re.findall(r"```yaml\n(.*?)```", text, re.S)
    return [yaml.safe_load(textwrap.dedent(b)) for b in blocks if needle in b]


@needs_kubectl
def test_documented_overlay_snippets_render_as_described() -> None:
    """The checklist's patches (model cache PVC, PodMonitor release label) and its images entry,
    added to an overlay, do what the text says."""
    text = doc()
    (pvc,) = yaml_blocks(text, "hf-cache")
    (release,) = yaml_blocks(text, "my-prometheus-release")
    (images,) = [b for b in yaml_blocks(text, "newName") if "registry.mycorp" in str(b)]
    patches = yaml.safe_dump(pvc["patches"] + release["patches"])
    objs = render_overlay_plus("xpyd", patches=patches, images=yaml.safe_dump(images["images"]))
    for t in role_templates(objs, "prefill") + role_templates(objs, "decode"):
        volume = next(v for v in t.spec["volumes"] if v["name"] == "hf-cache")
        assert volume == {"name": "hf-cache", "persistentVolumeClaim": {"claimName": "hf-cache"}}
        # The weights no longer take node disk: no ephemeral-storage reserved for them.
        assert "ephemeral-storage" not in t.container("vllm")["resources"]["requests"]
    assert kc.problems(objs) == []  # `make k8s-check` accepts the checklist's overlay
    assert {pm["metadata"]["labels"]["release"] for pm in find(objs, "PodMonitor")} == {
        "my-prometheus-release"
    }
    proxy = find(objs, "Deployment", "pcp-pd-proxy")[0]
    image = proxy["spec"]["template"]["spec"]["containers"][0]["image"]
    assert image == "registry.mycorp.example/pcp-pd-kit/pd-proxy:0.1.0"


def test_documented_router_versions_are_the_pinned_ones() -> None:
    text = doc()
    versions = params_file(COMPONENTS_DIR / "llm-d-router" / "versions.env")
    assert f"--version {versions['ROUTER_CHART_VERSION']}" in text
    for key in ("ROUTER_EPP_IMAGE", "ROUTER_SIDECAR_IMAGE"):
        assert versions[key] in text
    assert f"download/{versions['GAIE_VERSION']}/" in text


def test_contract_table_covers_the_prefill_fields() -> None:
    text = doc()
    for field in (
        "do_remote_decode: true",
        "do_remote_prefill: false",
        "remote_engine_id: null",
        "remote_block_ids: null",
        "remote_host: null",
        "remote_port: null",
        "`max_tokens`",
        "`stream`",
        "connector_nixlv2.go",
    ):
        assert field in text, field
