"""What the manifests mean: selectors, GPUs, the connector, NIXL, probes, secrets, proxy
discovery, transports, LeaderWorkerSet and llm-d's router. Each check runs on the real renders
and on a broken copy, to show it can fail."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from tests.k8s import checks as ck
from tests.k8s.manifests import COMPONENTS_DIR, REPO, find, generated, render_with, role_templates
from tests.k8s.renders import ALL_RENDERS, OVERLAY_NAMES, needs_kubectl, rendered

pytestmark = needs_kubectl

SHM_BYTES = 16 * 2**30  # .env.example SHM_SIZE=16g (test_k8s_params ties the two)
START_PERIOD_S = 30 * 60  # .env.example VLLM_START_PERIOD=30m (likewise)
VLLM_RENDERS = ALL_RENDERS
PROXY_RENDERS = [r for r in ALL_RENDERS if "router" not in r]


@pytest.mark.parametrize("name", ALL_RENDERS)
def test_service_selectors_match_pod_labels(name: str) -> None:
    objs = rendered(name)
    assert ck.check_service_selectors(objs) == []
    assert ck.check_headless_roles(objs) == []


@pytest.mark.parametrize("name", ALL_RENDERS)
def test_gpus_are_tp_x_pcp_for_prefill_and_tp_for_decode(name: str) -> None:
    assert ck.check_gpus(rendered(name)) == []


@pytest.mark.parametrize("name", ALL_RENDERS)
def test_pods_leave_gpu_choice_to_the_device_plugin(name: str) -> None:
    assert ck.check_pods_pick_no_gpus(rendered(name)) == []


def test_gpu_choice_check_fails_when_a_pod_gets_a_role_list() -> None:
    objs = base()
    vllm(objs, "pcp-pd-decode").setdefault("env", []).extend(
        [{"name": "KIT_ROLE_GPUS", "value": "0,1"}, {"name": "KIT_ROLE_REPLICAS", "value": "2"}]
    )
    problems = ck.check_pods_pick_no_gpus(objs)
    assert len(problems) == 1 and "looked up a replica index" in problems[0], problems


def test_connector_configmap_is_the_connector_package() -> None:
    assert ck.check_connector_configmap(rendered("base")) == []


@pytest.mark.parametrize("name", VLLM_RENDERS)
def test_vllm_loads_the_kit_connector(name: str) -> None:
    assert ck.check_vllm_connector(rendered(name)) == []


@pytest.mark.parametrize("name", VLLM_RENDERS)
def test_side_channel_host_is_the_pod_ip(name: str) -> None:
    assert ck.check_side_channel(rendered(name)) == []


@pytest.mark.parametrize("name", VLLM_RENDERS)
def test_vllm_http_port_and_probes(name: str) -> None:
    assert ck.check_vllm_http(rendered(name), START_PERIOD_S) == []


@pytest.mark.parametrize("name", VLLM_RENDERS)
def test_dev_shm_is_a_memory_emptydir(name: str) -> None:
    assert ck.check_shm(rendered(name), SHM_BYTES) == []


@pytest.mark.parametrize("name", VLLM_RENDERS)
def test_vllm_secrets_come_from_secret_files(name: str) -> None:
    assert ck.check_vllm_secrets(rendered(name)) == []


@pytest.mark.parametrize("name", ALL_RENDERS)
def test_hardening_as_in_compose(name: str) -> None:
    assert ck.check_hardening(rendered(name)) == []


@pytest.mark.parametrize("name", ALL_RENDERS)
def test_references_resolve(name: str) -> None:
    assert ck.check_references(rendered(name)) == []


@pytest.mark.parametrize("name", PROXY_RENDERS)
def test_proxy_watches_the_services_with_least_rbac_and_reads_key_files(name: str) -> None:
    assert ck.check_proxy(rendered(name)) == []


def vllm_environment_variables() -> set[str] | None:
    """Names vLLM knows (vllm/envs.py of the installed vLLM), or None without vLLM."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    envs = Path(next(iter(spec.submodule_search_locations))) / "envs.py"
    return set(re.findall(r'^\s+"(VLLM_[A-Z0-9_]+)": ', envs.read_text(), re.M))


@pytest.mark.parametrize("name", ["base", "overlay:xpyd", "lws", "router"])
def test_only_known_vllm_variables(name: str) -> None:
    known = vllm_environment_variables()
    if not known:
        pytest.skip("vLLM is not installed: its list of environment variables is unknown")
    names = ck.vllm_env_names(rendered(name))
    assert "VLLM_NIXL_SIDE_CHANNEL_HOST" in names
    assert ck.known_vllm_env(names, known) == []
    assert ck.known_vllm_env({"VLLM_EXTRA_ARGS"}, known)


@pytest.mark.parametrize(
    "name", ["rdma", "lws", "overlay:xpyd", "xpyd+lws", "router-lws-monitoring"]
)
def test_rdma_transport(name: str) -> None:
    assert ck.check_transport_rdma(rendered(name)) == []


def test_rdma_transport_without_the_operators_resource_is_reported() -> None:
    problems = ck.check_transport_rdma(render_with("transport-rdma"))
    assert problems and all("RDMA device resource" in p for p in problems), problems


@pytest.mark.parametrize("name", ["tcp", "overlay:1p1d", "router"])
def test_tcp_transport(name: str) -> None:
    assert ck.check_transport_tcp(rendered(name)) == []


@pytest.mark.parametrize("name", ["lws", "xpyd+lws", "router-lws-monitoring"])
def test_leaderworkerset(name: str) -> None:
    assert ck.check_lws(rendered(name)) == []


def router_values() -> dict:
    return yaml.safe_load((COMPONENTS_DIR / "llm-d-router" / "router.values.yaml").read_text())


@pytest.mark.parametrize(
    "name", ["router", "router-standalone", "router-lws-monitoring", "xpyd+router+lws"]
)
def test_llm_d_router_component(name: str) -> None:
    assert ck.check_router(rendered(name), router_values()) == []


def test_router_plugins_config_parses() -> None:
    config = yaml.safe_load(
        router_values()["router"]["epp"]["pluginsCustomConfig"]["pcp-pd-kit.yaml"]
    )
    refs = {p["pluginRef"] for prof in config["schedulingProfiles"] for p in prof["plugins"]}
    assert refs <= {p.get("name") or p["type"] for p in config["plugins"]}
    assert {prof["name"] for prof in config["schedulingProfiles"]} == {"prefill", "decode"}


def test_router_versions_are_pinned() -> None:
    versions = dict(
        line.split("=", 1)
        for line in (COMPONENTS_DIR / "llm-d-router" / "versions.env").read_text().splitlines()
        if line and not line.startswith("#")
    )
    assert re.fullmatch(r"v\d+\.\d+\.\d+", versions["ROUTER_CHART_VERSION"])
    kustomization = (COMPONENTS_DIR / "llm-d-router" / "kustomization.yaml").read_text()
    tag = versions["ROUTER_SIDECAR_IMAGE"].rsplit(":", 1)[1]
    assert f"newTag: {tag}" in kustomization
    for key in ("ROUTER_EPP_IMAGE", "ROUTER_SIDECAR_IMAGE"):
        assert re.search(r":v\d+\.\d+\.\d+$", versions[key]), key


def test_the_documented_overlays_are_among_the_renders() -> None:
    """The overlays docs/kubernetes.md offers are found (a folder with a kustomization.yaml), so
    every check over ALL_RENDERS walks them; a renamed or broken overlay folder fails here."""
    assert {"overlay:1p1d", "overlay:xpyd"} <= set(OVERLAY_NAMES), OVERLAY_NAMES


# ------------------------------------------------------------------ the checks can fail


def base() -> list[dict]:
    return rendered("base")


def deployment(objs: list[dict], name: str) -> dict:
    return find(objs, "Deployment", name)[0]


def vllm(objs: list[dict], name: str) -> dict:
    return deployment(objs, name)["spec"]["template"]["spec"]["containers"][0]


def test_selector_check_fails_on_a_wrong_role() -> None:
    objs = base()
    find(objs, "Service", "pcp-pd-decode")[0]["spec"]["selector"]["llm-d.ai/role"] = "prefill"
    assert ck.check_service_selectors(objs)


def test_selector_check_fails_on_a_missing_target_port() -> None:
    objs = base()
    find(objs, "Service", "pcp-pd-prefill")[0]["spec"]["ports"][0]["targetPort"] = "api"
    assert ck.check_service_selectors(objs)


def test_gpu_check_fails_when_limits_and_knobs_disagree() -> None:
    objs = base()
    vllm(objs, "pcp-pd-prefill")["resources"]["limits"]["nvidia.com/gpu"] = "1"
    assert ck.check_gpus(objs)
    objs = base()
    generated(objs, "ConfigMap", "pcp-pd-params")["data"]["PREFILLER_PCP_SIZE"] = "4"
    assert ck.check_gpus(objs)


def test_connector_check_fails_on_a_missing_or_changed_file() -> None:
    objs = base()
    data = generated(objs, "ConfigMap", "pcp-pd-connector")["data"]
    data.pop("topology.py")
    assert any("topology.py" in p for p in ck.check_connector_configmap(objs))
    objs = base()
    generated(objs, "ConfigMap", "pcp-pd-connector")["data"]["stats.py"] += "\n# drift\n"
    assert ck.check_connector_configmap(objs)


def test_connector_check_fails_when_an_item_is_missing() -> None:
    objs = base()
    for v in deployment(objs, "pcp-pd-decode")["spec"]["template"]["spec"]["volumes"]:
        if v["name"] == "connector":
            v["configMap"]["items"].pop()
    assert any("missing" in p for p in ck.check_vllm_connector(objs))


def test_connector_check_fails_without_pythonpath_or_with_another_mount() -> None:
    objs = base()
    env = vllm(objs, "pcp-pd-decode")["env"]
    next(e for e in env if e["name"] == "PYTHONPATH")["value"] = "/opt/elsewhere"
    assert ck.check_vllm_connector(objs)
    objs = base()
    vllm(objs, "pcp-pd-prefill")["volumeMounts"][0]["mountPath"] = "/opt/pcp-pd-kit/connector/x"
    assert ck.check_vllm_connector(objs)


def test_connector_check_fails_on_another_module_path() -> None:
    objs = base()
    generated(objs, "ConfigMap", "pcp-pd-params")["data"]["KV_CONNECTOR_MODULE_PATH"] = "nixl"
    assert ck.check_vllm_connector(objs)


def env_item(container: dict, name: str) -> dict:
    return next(e for e in container["env"] if e["name"] == name)


def test_connector_check_fails_on_a_swapped_or_missing_role() -> None:
    """The role is an environment value the entrypoint turns into kv_role: the check reads the
    config the entrypoint builds, so a swapped or missing KIT_KV_ROLE is caught."""
    objs = base()
    env_item(vllm(objs, "pcp-pd-decode"), "KIT_KV_ROLE")["value"] = "kv_producer"
    problems = ck.check_vllm_connector(objs)
    assert problems == ["Deployment/pcp-pd-decode: kv_role 'kv_producer', want kv_consumer"]
    objs = base()
    container = vllm(objs, "pcp-pd-prefill")
    container["env"].remove(env_item(container, "KIT_KV_ROLE"))
    problems = ck.check_vllm_connector(objs)
    assert len(problems) == 1 and "refuses to start: KIT_KV_ROLE=''" in problems[0], problems


def test_connector_check_fails_on_an_unusable_connector_or_a_second_config() -> None:
    objs = base()
    generated(objs, "ConfigMap", "pcp-pd-params")["data"]["KV_CONNECTOR"] = ""
    problems = ck.check_vllm_connector(objs)
    assert len(problems) == 2 and all("KIT_KV_CONNECTOR is not set" in p for p in problems)
    objs = base()
    vllm(objs, "pcp-pd-decode")["args"] += ["--kv-transfer-config", '{"kv_role":"kv_both"}']
    problems = ck.check_vllm_connector(objs)
    assert len(problems) == 1 and "is in the arguments" in problems[0], problems


def test_connector_check_covers_lws_workers() -> None:
    objs = rendered("lws")
    lws = find(objs, "LeaderWorkerSet")[0]
    worker = lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]
    env_item(worker, "KIT_KV_ROLE")["value"] = "kv_consumer"
    problems = ck.check_vllm_connector(objs)
    assert problems == [
        "LeaderWorkerSet/pcp-pd-prefill-lws/worker: kv_role 'kv_consumer', want kv_producer"
    ]


def test_side_channel_check_fails_on_a_fixed_host() -> None:
    objs = base()
    env = vllm(objs, "pcp-pd-prefill")["env"]
    item = next(e for e in env if e["name"] == "VLLM_NIXL_SIDE_CHANNEL_HOST")
    item.pop("valueFrom")
    item["value"] = "10.0.0.1"
    assert ck.check_side_channel(objs)


def test_http_check_fails_on_a_port_mismatch() -> None:
    objs = base()
    vllm(objs, "pcp-pd-decode")["ports"][0]["containerPort"] = 8300
    assert ck.check_vllm_http(objs, START_PERIOD_S)
    assert ck.check_vllm_http(base(), START_PERIOD_S * 2)


def test_shm_check_fails_on_disk_backed_shm() -> None:
    objs = base()
    for v in deployment(objs, "pcp-pd-prefill")["spec"]["template"]["spec"]["volumes"]:
        if v["name"] == "dshm":
            v["emptyDir"].pop("medium")
    assert ck.check_shm(objs, SHM_BYTES)
    assert ck.check_shm(base(), SHM_BYTES // 2)


def test_secret_check_fails_on_a_literal_key_or_a_missing_mount() -> None:
    objs = base()
    vllm(objs, "pcp-pd-decode")["env"].append({"name": "VLLM_API_KEY", "value": "sk-123"})
    assert ck.check_vllm_secrets(objs)
    objs = base()
    mounts = vllm(objs, "pcp-pd-prefill")["volumeMounts"]
    mounts[:] = [m for m in mounts if m["mountPath"] != "/run/kit-keys"]
    assert ck.check_vllm_secrets(objs)
    objs = base()  # the package's modules one folder too high: `python3 .../vllm_serve` finds none
    for mount in vllm(objs, "pcp-pd-decode")["volumeMounts"]:
        if mount["name"] == "entrypoint":
            mount["mountPath"] = "/opt/pcp-pd-kit/entrypoint"
    assert any("the kit's entrypoint is not mounted" in p for p in ck.check_vllm_secrets(objs))


def test_proxy_check_fails_on_a_wrong_port_rbac_or_key_file() -> None:
    objs = base()
    env = deployment(objs, "pcp-pd-proxy")["spec"]["template"]["spec"]["containers"][0]["env"]
    item = next(e for e in env if e["name"] == "PD_PROXY_DECODE_K8S_SERVICE")
    item["value"] = "pcp-pd-decode:metrics"
    assert any("has no port 'metrics'" in p for p in ck.check_proxy(objs))
    objs = base()
    find(objs, "Role", "pcp-pd-proxy-endpointslices")[0]["rules"][0]["verbs"].append("get")
    find(objs, "Role", "pcp-pd-proxy-endpointslices")[0]["rules"].append(
        {"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"]}
    )
    assert any("grants" in p for p in ck.check_proxy(objs))
    objs = base()
    deployment(objs, "pcp-pd-proxy")["spec"]["template"]["spec"]["serviceAccountName"] = "default"
    assert ck.check_proxy(objs)
    objs = base()
    spec = deployment(objs, "pcp-pd-proxy")["spec"]["template"]["spec"]
    spec["containers"][0]["volumeMounts"] = [
        m for m in spec["containers"][0]["volumeMounts"] if m["mountPath"] != "/tmp"
    ]
    assert any("/tmp" in p for p in ck.check_proxy(objs))
    objs = base()
    env = deployment(objs, "pcp-pd-proxy")["spec"]["template"]["spec"]["containers"][0]["env"]
    next(e for e in env if e["name"] == "PD_PROXY_BACKEND_API_KEY_FILE")["value"] = "/tmp/key"
    assert ck.check_proxy(objs)


def test_hardening_check_fails_when_a_transport_drops_it() -> None:
    objs = rendered("rdma")
    vllm(objs, "pcp-pd-prefill")["securityContext"] = {"capabilities": {"add": ["IPC_LOCK"]}}
    assert ck.check_hardening(objs)
    objs = base()
    deployment(objs, "pcp-pd-proxy")["spec"]["template"]["spec"].pop("securityContext")
    assert ck.check_hardening(objs)
    objs = rendered("lws")  # the token would be mounted by default, as before
    lws = find(objs, "LeaderWorkerSet")[0]["spec"]["leaderWorkerTemplate"]
    lws["workerTemplate"]["spec"].pop("automountServiceAccountToken")
    assert ck.check_hardening(objs) == [
        "LeaderWorkerSet/pcp-pd-prefill-lws/worker: the ServiceAccount token is mounted into "
        "vLLM's pod"
    ]


def test_reference_check_fails_on_an_unknown_secret() -> None:
    objs = base()
    spec = deployment(objs, "pcp-pd-decode")["spec"]["template"]["spec"]
    spec["volumes"].append({"name": "x", "secret": {"secretName": "surprise"}})
    assert ck.check_references(objs)


def test_transport_checks_fail_on_the_other_transport() -> None:
    assert ck.check_transport_rdma(rendered("tcp"))
    assert ck.check_transport_tcp(rendered("rdma"))


def test_lws_check_fails_when_workers_serve() -> None:
    objs = rendered("lws")
    lws = find(objs, "LeaderWorkerSet")[0]
    args = lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]["args"]
    args.remove("--headless")
    assert ck.check_lws(objs)
    assert ck.check_lws(base())


def test_lws_gpus_fail_when_a_pod_has_none() -> None:
    objs = rendered("lws")
    lws = find(objs, "LeaderWorkerSet")[0]
    worker = lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]
    worker["resources"]["limits"]["nvidia.com/gpu"] = "0"
    assert ck.check_gpus(objs)


def test_router_check_fails_on_unmatched_labels_or_ports() -> None:
    values = router_values()
    values["router"]["modelServers"]["matchLabels"]["llm-d.ai/guide"] = "other"
    assert ck.check_router(rendered("router"), values)
    assert ck.check_router(base(), router_values())


def test_role_templates_cover_lws_workers() -> None:
    owners = [t.owner for t in role_templates(rendered("lws"), "prefill")]
    assert owners == [
        "LeaderWorkerSet/pcp-pd-prefill-lws/leader",
        "LeaderWorkerSet/pcp-pd-prefill-lws/worker",
    ]
    assert (REPO / "deploy/k8s/components/lws-prefill/namereference.yaml").exists()
