"""docs/kubernetes.md describes what is there: every overlay and component, the Secrets the
manifests expect, the render flag, and the router versions that are actually pinned."""

from __future__ import annotations

from tests.k8s import checks as ck
from tests.k8s.manifests import COMPONENTS_DIR, REPO, components, overlays, params_file

DOC = REPO / "docs" / "kubernetes.md"


def doc() -> str:
    return DOC.read_text()


def test_every_overlay_and_component_is_documented() -> None:
    text = doc()
    missing = [p.name for p in [*overlays(), *components()] if f"{p.name}/" not in text]
    assert missing == []


def test_expected_secrets_and_keys_are_documented() -> None:
    text = doc()
    for secret in ck.EXPECTED_SECRETS:
        assert f"create secret generic {secret}" in text
    for key in ("vllm_api_key", "api_keys", "hf_token"):
        assert key in text


def test_render_command_carries_the_load_restrictor_flag() -> None:
    assert "--load-restrictor LoadRestrictionsNone" in doc()


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
