"""compose.yaml as the pinned `docker compose config` renders it, against the topology and the
security the kit promises. Every check passes on the real file and is shown failing on a broken
copy (or model) or a bad override."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest

from pcp_pd_kit.settings import read_env_file
from tests.compose import checks as cc
from tests.compose import compose_cli as cli
from tests.entrypoint.loader import command, cpu_topology
from tests.support.paths import COMPOSE_FILE, DEBUG_PORTS_FILE, ENV_EXAMPLE, REPO

ALL_PROFILES = ("gpu", "cpu", "grafana")


def vllm_version() -> str:
    """The vLLM release the kit pins (constraints.txt), which the images must match."""
    match = re.search(r"^vllm(?:-cpu)?==(\S+)", (REPO / "constraints.txt").read_text(), re.M)
    assert match, "constraints.txt pins no vllm"
    return match.group(1)


def render(tmp_path: Path, overrides: dict[str, str], **kwargs) -> tuple[dict, dict[str, str]]:
    """The model and the settings it was rendered with, for .env.example plus ``overrides``."""
    env_path = cli.env_file(tmp_path, overrides)
    return cli.config(env_file=env_path, **kwargs), read_env_file(env_path)


@pytest.fixture(scope="module")
def gpu() -> dict:
    return cli.config()


@pytest.fixture(scope="module")
def cpu() -> dict:
    return cli.config(profiles=["cpu"])


@pytest.fixture(scope="module")
def everything() -> dict:
    return cli.config(profiles=ALL_PROFILES)


@pytest.fixture(scope="module")
def bare() -> dict:
    return cli.config(env_file=cli.BARE)


# ------------------------------------------------------------------------------ Compose accepts it
@pytest.mark.parametrize(
    ("env_file", "profiles", "files"),
    [
        (ENV_EXAMPLE, (), (COMPOSE_FILE,)),
        (cli.BARE, (), (COMPOSE_FILE,)),
        (ENV_EXAMPLE, ("cpu",), (COMPOSE_FILE,)),
        (cli.BARE, ("cpu", "grafana"), (COMPOSE_FILE,)),
        (ENV_EXAMPLE, ALL_PROFILES, (COMPOSE_FILE, DEBUG_PORTS_FILE)),
    ],
    ids=["env-example", "bare", "cpu", "bare-cpu-grafana", "all-with-debug-ports"],
)
def test_compose_accepts_the_file(env_file, profiles, files) -> None:
    res = cli.run("config", "--quiet", env_file=env_file, profiles=profiles, files=files)
    assert res.returncode == 0, res.stderr
    assert "variable is not set" not in res.stderr, res.stderr


def test_compose_rejects_a_broken_copy(tmp_path) -> None:
    edit = ("\n  holder:\n", "\n  holder:\n    bogus_key: 1\n")
    broken = cli.edited_copy(tmp_path, [edit], COMPOSE_FILE)
    res = cli.run("config", "--quiet", files=[broken])
    assert res.returncode != 0
    assert "bogus_key" in res.stderr


def test_bare_defaults_render_like_env_example(gpu, bare) -> None:
    assert bare["services"] == gpu["services"]


# ------------------------------------------------------------------------------ profiles
@pytest.mark.parametrize(
    ("profiles", "want"),
    [
        ((), {"keygen", "holder", "prefill", "decode", "proxy", "prometheus", "grafana"}),
        (("cpu",), {"keygen", "holder", "prefill-cpu", "decode-cpu", "proxy-cpu", "prometheus"}),
        (
            ("cpu", "grafana"),
            {"keygen", "holder", "prefill-cpu", "decode-cpu", "proxy-cpu", "prometheus", "grafana"},
        ),
    ],
    ids=["bare-up", "cpu", "cpu-grafana"],
)
def test_profiles_select_one_deployment(profiles, want) -> None:
    assert cli.services(env_file=cli.BARE, profiles=profiles) == want


def test_compose_profiles_from_the_environment_are_ignored(monkeypatch) -> None:
    """The tests never inherit COMPOSE_* (a developer's COMPOSE_PROFILES=cpu)."""
    monkeypatch.setenv("COMPOSE_PROFILES", "cpu")
    monkeypatch.setenv("PREFILLER_PCP_SIZE", "8")
    assert "prefill" in cli.services(env_file=cli.BARE)
    prefill = cli.config(env_file=cli.BARE)["services"]["prefill"]
    assert cc.flag_value(cc.command_args(prefill), "--prefill-context-parallel-size") == "2"


# ------------------------------------------------------------------------------ variables
def test_compose_sees_the_variables_the_text_scan_sees() -> None:
    """Guards the text scan below: it finds exactly the names Compose interpolates."""
    files = (COMPOSE_FILE, DEBUG_PORTS_FILE)
    scanned = {name for f in files for name, _, _ in cc.variable_uses(f.read_text())}
    assert scanned == set(cli.variables(env_file=cli.BARE, files=files))


def test_every_variable_has_a_default_equal_to_env_example(env_example) -> None:
    for path in (COMPOSE_FILE, DEBUG_PORTS_FILE):
        assert cc.check_variable_defaults(cc.variable_uses(path.read_text()), env_example) == []
    reported = cli.variables(env_file=cli.BARE, files=(COMPOSE_FILE, DEBUG_PORTS_FILE))
    wrong = {
        name: (v["DefaultValue"], env_example[name])
        for name, v in reported.items()
        if name in env_example and v["DefaultValue"] != env_example[name]
    }
    assert not wrong, wrong
    assert not [name for name, v in reported.items() if v["Required"]]


def test_variable_check_catches_a_drifted_default_and_a_bare_variable(env_example) -> None:
    text = COMPOSE_FILE.read_text()
    assert "${MOE_BACKEND:-auto}" in text and "${SHM_SIZE:-16g}" in text
    text = text.replace("${MOE_BACKEND:-auto}", "${MOE_BACKEND:-flashinfer_cutlass}", 1)
    text = text.replace("${SHM_SIZE:-16g}", "${NEW_KNOB}")
    problems = cc.check_variable_defaults(cc.variable_uses(text), env_example)
    assert any(p.startswith("MOE_BACKEND") for p in problems), problems
    assert any(p.startswith("NEW_KNOB") for p in problems), problems


def test_kit_settings_show_the_knobs(tmp_path, gpu, env_example) -> None:
    assert cc.check_kit_settings(gpu, env_example) == []
    overrides = {var: f"x{i}" for i, var in enumerate(cc.KIT_SETTINGS.values())}
    overrides |= {"PD_SUBNET": "10.9.0.0/24", "PROXY_PORT": "8001", "PROMETHEUS_PORT": "9091"}
    overrides |= {"GRAFANA_PORT": "3001", "PROXY_BIND_ADDRESS": "127.0.0.3"}
    overrides |= {"BIND_ADDRESS": "127.0.0.2", "VLLM_IMAGE": "vllm/vllm-openai:v9"}
    overrides |= {"HF_CACHE_DIR": "/srv/hf-cache"}
    # Compose casts the replica counts itself (`scale:`): numbers, not markers.
    overrides |= {"PREFILL_REPLICAS": "3", "DECODE_REPLICAS": "4"}
    model, settings = render(tmp_path, overrides)
    assert cc.check_kit_settings(model, settings) == []
    broken = copy.deepcopy(model)
    broken["x-kit-settings"]["decode_gpus"] = settings["PREFILL_GPUS"]
    del broken["x-kit-settings"]["prefill_pcp_size"]
    problems = cc.check_kit_settings(broken, settings)
    assert any("decode_gpus" in p for p in problems), problems
    assert any("prefill_pcp_size" in p for p in problems), problems


def test_env_example_keeps_local_stack_section_last(repo) -> None:
    lines = [ln for ln in (repo / ".env.example").read_text().splitlines() if ln.strip()]
    header = "# --- Local CPU stack (make demo / make up) ---"
    assert header in lines
    after = lines[lines.index(header) + 1 :]
    compose_knobs = cli.variable_names(COMPOSE_FILE.read_text())
    assert not [ln for ln in after if ln.split("=", 1)[0] in compose_knobs]


# ------------------------------------------------------------------------------ KV roles
@pytest.mark.parametrize("model", ["gpu", "cpu"])
def test_kv_roles_and_connector(request, model, env_example) -> None:
    assert cc.check_kv_roles(request.getfixturevalue(model), env_example) == []


def test_kv_config_is_the_entrypoints(gpu, cpu) -> None:
    """The compose file writes no JSON: each vLLM service's config is what the entrypoint builds
    from its environment, appended to its command."""
    for model in (gpu, cpu):
        services = cc.vllm_services(model)
        assert set(services) in ({"prefill", "decode"}, {"prefill-cpu", "decode-cpu"})
        for name, service in services.items():
            assert cc.flag_value(cc.command_args(service), "--kv-transfer-config") is None, name
            argv = cc.exec_argv(service)
            assert argv[:3] == ["python3", "-m", command.API_SERVER], name
            env = service.get("environment") or {}
            ranks = int(env.get("KIT_CPU_PCP_SIZE") or 1)
            topology, _ = cpu_topology.cpu_topology(env, list(range(ranks)))
            # Then the KV events config (tests/compose/test_compose_cache.py), then the KV one.
            assert argv[3:-4] == [*cc.command_args(service), *topology], name
            assert argv[-4] == "--kv-events-config", name
            assert argv[-2] == "--kv-transfer-config", name
    # The CPU prefill runs the kit's topology (PCP2 + EP2) through the entrypoint.
    cpu_prefill = cc.exec_argv(cc.vllm_services(cpu)["prefill-cpu"])
    assert cc.flag_value(cpu_prefill, "--prefill-context-parallel-size") == "2"
    assert "--enable-expert-parallel" in cpu_prefill


def test_kv_roles_check_catches_swapped_role_and_bad_json(tmp_path, env_example) -> None:
    broken = cli.edited_copy(
        tmp_path, [("KIT_KV_ROLE: kv_consumer", "KIT_KV_ROLE: kv_producer")], COMPOSE_FILE
    )
    problems = cc.check_kv_roles(cli.config(files=[broken]), env_example)
    assert any(p.startswith("decode: kv_role") for p in problems), problems
    problems = cc.check_kv_roles(cli.config(files=[broken], profiles=["cpu"]), env_example)
    assert any(p.startswith("decode-cpu: kv_role") for p in problems), problems
    model, settings = render(tmp_path, {"NIXL_PROGRESS_DELAY_US": "1000,"}, profiles=["cpu"])
    problems = cc.check_kv_roles(model, settings)
    assert any("refuses to start" in p and "NIXL_PROGRESS_DELAY_US" in p for p in problems)


@pytest.mark.parametrize(
    ("overrides", "edits", "profiles", "needle"),
    [
        ({}, [("KIT_KV_ROLE: kv_producer", "KIT_KV_ROLE: producer")], (), "prefill: "),
        ({}, [("      KIT_KV_ROLE: kv_consumer\n", "")], (), "decode: "),
        (
            {},
            [("  KIT_KV_CONNECTOR: ${KV_CONNECTOR:-PcpCanonicalNixlConnector}\n", "")],
            ("cpu",),
            "KIT_KV_CONNECTOR is not set",
        ),
        ({"NIXL_PROGRESS_DELAY_US": "1ms"}, [], ("cpu",), "decode-cpu: "),
        ({"VLLM_EXTRA_ARGS": "--kv-transfer-config {}"}, [], (), "is in the arguments"),
    ],
    ids=["unknown-role", "no-role", "no-connector", "bad-delay", "flag-in-extra-args"],
)
def test_kv_roles_check_reports_what_the_entrypoint_refuses(
    tmp_path, overrides, edits, profiles, needle
) -> None:
    """Compose renders all of these; the container would exit at once: the check says so."""
    files = [cli.edited_copy(tmp_path, edits, COMPOSE_FILE)] if edits else [COMPOSE_FILE]
    model, settings = render(tmp_path, overrides, profiles=profiles, files=files)
    problems = cc.check_kv_roles(model, settings)
    assert any(needle in p and "refuses to start" in p for p in problems), problems


# ------------------------------------------------------------------------------ GPU topology
@pytest.mark.parametrize("model", ["gpu", "bare"])
def test_gpu_topology(request, model, env_example) -> None:
    assert cc.check_gpu_topology(request.getfixturevalue(model), env_example) == []


def test_gpu_flags_follow_the_variables(tmp_path) -> None:
    overrides = {
        "PREFILLER_TP_SIZE": "2",
        "PREFILLER_PCP_SIZE": "2",
        "PREFILL_GPUS": "0,1,2,3",
        "DECODER_TP_SIZE": "2",
        "DECODE_GPUS": "4,5",
        "MOE_BACKEND": "flashinfer_cutlass",
        "PREFILL_GPU_MEMORY_UTILIZATION": "0.7",
        "DECODE_GPU_MEMORY_UTILIZATION": "0.6",
    }
    model, settings = render(tmp_path, overrides)
    assert cc.check_gpu_topology(model, settings) == []
    xpyd = {"PREFILL_REPLICAS": "2", "DECODE_REPLICAS": "2", "PREFILL_GPUS": "0,1,2,3"}
    assert cc.check_gpu_topology(*render(tmp_path, {**xpyd, "DECODE_GPUS": "4,5"})) == []
    for name in ("prefill", "decode"):
        service = model["services"][name]
        assert cc.reserves_all_gpus(service) and cc.gpu_device_ids(service) == [], name
        assert cc.environment(service)["KIT_ALL_GPUS"] == "all", name


@pytest.mark.parametrize(
    ("value", "eager"),
    [("", False), ("1", True), ("0", False), ("true", True), ("off", False)],
    ids=["default", "eager", "zero", "true", "off"],
)
def test_enforce_eager_knob(tmp_path, value, eager) -> None:
    """The entrypoint decides (KIT_ENFORCE_EAGER): ENFORCE_EAGER=0 is off, not a non-empty on."""
    model, settings = render(tmp_path, {"ENFORCE_EAGER": value})
    for name in ("prefill", "decode"):
        service = model["services"][name]
        assert cc.environment(service)["KIT_ENFORCE_EAGER"] == value, name
        args = cc.exec_argv(service)
        assert ("--enforce-eager" in args) is eager, (name, args)
        assert "--enforce-eager" not in cc.command_args(service), name
    assert model["x-kit-settings"]["enforce_eager"] == value
    assert cc.check_gpu_topology(model, settings) == []


def test_a_bad_enforce_eager_is_refused_before_vllm(tmp_path) -> None:
    model, _ = render(tmp_path, {"ENFORCE_EAGER": "yes"})
    with pytest.raises(ValueError, match="KIT_ENFORCE_EAGER='yes'"):
        cc.exec_argv(model["services"]["prefill"])


@pytest.mark.parametrize("model", ["gpu", "bare"])
def test_gpu_device_requests_name_one_gpu_each(request, model) -> None:
    """No device_ids entry is a comma list: an engine routing driver nvidia through CDI turns
    each entry into nvidia.com/gpu=<entry>, and nvidia.com/gpu=0,1 does not exist."""
    services = request.getfixturevalue(model)["services"]
    for name in ("prefill", "decode"):
        requests = cc.gpu_requests(services[name])
        assert requests, name
        for device in requests:
            assert all("," not in str(e) for e in device.get("device_ids") or []), device


@pytest.mark.parametrize(
    ("model", "servers"), [("gpu", ("prefill", "decode")), ("cpu", ("prefill-cpu", "decode-cpu"))]
)
def test_servers_share_namespaces_of_a_holder_with_init(request, model, servers) -> None:
    """The same holder in both profiles: the cpu profile runs the GPU services' structure."""
    compose = request.getfixturevalue(model)
    services = compose["services"]
    assert cc.namespace_holders(compose) == {"holder"}
    holder = services["holder"]
    assert holder["init"] is True and holder["ipc"] == "shareable"
    assert holder["image"] == services["keygen"]["image"]  # the kit's own: nothing to pull
    assert holder["restart"] == "unless-stopped"
    assert cc.container_argv(holder) == ["python3", "/opt/pcp-pd-kit/entrypoint/holder.py"]
    # It drains the servers on SIGTERM: its grace outlasts its drain, which outlasts vLLM's own.
    drain = float(cc.environment(holder)["KIT_HOLDER_DRAIN_S"])
    assert cc.seconds(holder["stop_grace_period"]) > drain
    for name in servers:
        shutdown = cc.flag_value(cc.command_args(services[name]), "--shutdown-timeout")
        assert shutdown is not None and drain > float(shutdown), name
    for name in servers:
        assert services[name]["ipc"] == services[name]["pid"] == "service:holder", name
        assert services[name]["depends_on"]["holder"]["restart"] is True, name
        assert services[name]["restart"] == "unless-stopped", name
        # /dev/shm is the holder's; the servers repeat its size (Docker ignores it there)
        assert services[name]["shm_size"] == holder["shm_size"], name
    assert servers[0] not in services[servers[1]]["depends_on"]


def test_gpu_and_cpu_servers_differ_only_where_they_must(gpu, cpu) -> None:
    assert cc.check_server_parity(gpu, cpu) == []


@pytest.mark.parametrize(
    ("edits", "needle"),
    [
        (
            [
                (
                    "  pull_policy: never\n  # vLLM's CPU",
                    "  restart: on-failure:3\n  pull_policy: never\n  # vLLM's CPU",
                )
            ],
            "prefill-cpu: restart 'on-failure:3'",
        ),
        (
            [
                (
                    "  pull_policy: never\n  # vLLM's CPU",
                    "  ipc: private\n  pull_policy: never\n  # vLLM's CPU",
                )
            ],
            "decode-cpu: ipc 'private'",
        ),
        (
            [
                (
                    "  pull_policy: never\n  # vLLM's CPU",
                    "  entrypoint: [vllm, serve]\n  pull_policy: never\n  # vLLM's CPU",
                )
            ],
            "prefill-cpu: entrypoint",
        ),
        (
            [
                (
                    '      KIT_CPU_PCP_SIZE: "1"\n',
                    '      KIT_CPU_PCP_SIZE: "1"\n      KIT_ENFORCE_EAGER: "1"\n',
                )
            ],
            "decode-cpu: KIT_ENFORCE_EAGER '1'",
        ),
        (
            [
                (
                    "      --host 0.0.0.0 --port 8200\n      --block-size ${CPU_BLOCK",
                    "      --host 0.0.0.0 --port 8201\n      --block-size ${CPU_BLOCK",
                )
            ],
            "decode-cpu: --port '8201'",
        ),
    ],
    ids=["restart", "ipc", "entrypoint", "env", "port"],
)
def test_parity_check_catches_a_drifted_cpu_service(tmp_path, gpu, edits, needle) -> None:
    broken = cli.edited_copy(tmp_path, edits, COMPOSE_FILE)
    cpu = cli.config(files=[broken], profiles=["cpu"])
    problems = cc.check_server_parity(gpu, cpu)
    assert any(needle in p for p in problems), problems


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        ({"PREFILLER_PCP_SIZE": "4"}, "TP x PCP = 4"),
        ({"PREFILLER_TP_SIZE": "2"}, "TP x PCP = 4"),
        ({"DECODER_TP_SIZE": "2"}, "DECODE_REPLICAS x TP = 2"),
        ({"PREFILL_REPLICAS": "2"}, "PREFILL_REPLICAS x TP x PCP = 4"),
        ({"DECODE_REPLICAS": "3", "DECODE_GPUS": "2,3"}, "DECODE_REPLICAS x TP = 3"),
        ({"DECODE_GPUS": "1"}, "overlap"),
        ({"PREFILLER_TP_SIZE": "two"}, "not a positive integer"),
        ({"PREFILL_GPUS": "0,gpu1"}, "not a GPU index or UUID"),
        ({"DECODE_GPU_MEMORY_UTILIZATION": "85"}, "not a fraction"),
    ],
    ids=[
        "pcp4-2gpus",
        "tp2-2gpus",
        "decode-tp2-1gpu",
        "2p-2gpus",
        "3d-2gpus",
        "overlap",
        "tp-not-int",
        "bad-gpu-id",
        "mem",
    ],
)
def test_gpu_check_catches_bad_overrides(tmp_path, overrides, needle) -> None:
    """Compose renders all of these (it does not know what the values mean); the check does not."""
    model, settings = render(tmp_path, overrides)
    problems = cc.check_gpu_topology(model, settings)
    assert any(needle in p for p in problems), problems


@pytest.mark.parametrize(
    ("edits", "needle"),
    [
        (
            [("count: all", 'device_ids: ["${PREFILL_GPUS:-0,1}", "${DECODE_GPUS:-2}"]')],
            "names several GPUs",
        ),
        ([("count: all", 'device_ids: ["${DECODE_GPUS:-2}"]')], "do not cover"),
        ([("KIT_ALL_GPUS: all", "KIT_ALL_GPUS: 0,1,2")], "KIT_ALL_GPUS is '0,1,2'"),
        ([("ipc: service:holder", "ipc: private")], "decode: ipc"),
        ([("pid: service:holder", "pid: host")], "decode: pid"),
        ([("    ipc: shareable\n", "    ipc: private\n")], "holder: ipc"),
        ([("    init: true\n", "")], "holder: init"),
        ([("    shm_size: ${SHM_SIZE:-16g}\n", "")], "holder: shm_size"),
        (
            [
                (
                    "image: pcp-pd-kit/pd-proxy:0.1.0\n    pull_policy: never\n    init",
                    "image: busybox:1\n    init",
                )
            ],
            "holder: image 'busybox:1'",
        ),
        ([("      --enable-expert-parallel\n", "")], "--enable-expert-parallel"),
        (
            [("KIT_ROLE_REPLICAS: ${DECODE_REPLICAS:-1}", "KIT_ROLE_REPLICAS: 2")],
            "decode: scale 1, KIT_ROLE_REPLICAS '2'",
        ),
        (
            [
                (
                    "--gpu-memory-utilization ${DECODE_GPU_MEMORY_UTILIZATION:-0.85}",
                    "--gpu-memory-utilization ${PREFILL_GPU_MEMORY_UTILIZATION:-0.85}",
                )
            ],
            "DECODE_GPU_MEMORY_UTILIZATION",
        ),
    ],
    ids=[
        "comma-device-ids",
        "device-ids",
        "all-gpus-env",
        "decode-ipc",
        "decode-pid",
        "holder-ipc",
        "holder-init",
        "holder-shm",
        "holder-image",
        "no-ep",
        "decode-scale",
        "wrong-mem-var",
    ],
)
def test_gpu_check_catches_a_broken_copy(tmp_path, edits, needle) -> None:
    broken = cli.edited_copy(tmp_path, edits, COMPOSE_FILE)
    env_path = cli.env_file(tmp_path, {"PREFILL_GPU_MEMORY_UTILIZATION": "0.7"})
    model = cli.config(files=[broken], env_file=env_path)
    problems = cc.check_gpu_topology(model, read_env_file(env_path))
    assert any(needle in p for p in problems), problems


# ------------------------------------------------------------------------------ CPU deployment
def test_cpu_services(cpu, env_example) -> None:
    assert cc.check_cpu_services(cpu, env_example) == []


def test_cpu_services_follow_core_lists(tmp_path) -> None:
    cores = {"PREFILL_CPUS": "0-3", "DECODE_CPUS": "4-7,9"}
    model, settings = render(tmp_path, cores, profiles=["cpu"])
    assert cc.check_cpu_services(model, settings) == []


@pytest.mark.parametrize(
    ("overrides", "edits", "needle"),
    [
        ({"PREFILL_CPUS": "0-2"}, [], "cannot be split evenly over 2"),
        ({"PREFILL_CPUS": "0-"}, [], "not a CPU list"),
        ({}, [("cpuset: ${DECODE_CPUS:-1}", "cpuset: 1-2")], "cpuset '1-2' != DECODE_CPUS"),
        ({}, [('KIT_CPU_PCP_SIZE: "1"', 'KIT_CPU_PCP_SIZE: "2"')], "decode-cpu: KIT_CPU_PCP_SIZE"),
        (
            {},
            [
                (
                    '      KIT_CPU_PCP_SIZE: "1"\n',
                    '      KIT_CPU_PCP_SIZE: "1"\n      VLLM_CPU_OMP_THREADS_BIND: "1"\n',
                )
            ],
            "sets VLLM_CPU_OMP_THREADS_BIND",
        ),
        ({}, [("  cap_add: [SYS_NICE]\n", "")], "SYS_NICE"),
        ({"SHM_SIZE": "256m"}, [], "under 1g"),
        ({}, [("    ipc: shareable\n", "    ipc: private\n")], "holder: ipc"),
        (
            {},
            [("      KIT_KV_BUFFER_DEVICE: cpu\n", "")],
            "decode-cpu: cpu_skip_kv_core_pinning",
        ),
        ({}, [("      KIT_KV_BUFFER_DEVICE: cpu\n", "")], "prefill-cpu: kv_buffer_device"),
        (
            {},
            [("KIT_KV_BUFFER_DEVICE: cpu", "KIT_KV_BUFFER_DEVICE: cuda")],
            "prefill-cpu: kv_buffer_device 'cuda'",
        ),
        (
            {},
            [("${NIXL_PROGRESS_DELAY_US:-1000}", '"500"')],
            "cpu_nixl_progress_delay_us 500 != NIXL_PROGRESS_DELAY_US",
        ),
    ],
    ids=[
        "uneven-split",
        "bad-list",
        "cpuset-vs-knob",
        "decode-pcp",
        "pinned-omp",
        "no-sys-nice",
        "small-shm",
        "holder-ipc",
        "pinning",
        "buffer",
        "cuda-buffer",
        "fixed-delay",
    ],
)
def test_cpu_check_catches_breakage(tmp_path, overrides, edits, needle) -> None:
    files = [cli.edited_copy(tmp_path, edits, COMPOSE_FILE)] if edits else [COMPOSE_FILE]
    model, settings = render(tmp_path, overrides, profiles=["cpu"], files=files)
    problems = cc.check_cpu_services(model, settings)
    assert any(needle in p for p in problems), problems


def test_cpu_check_catches_an_entrypoint_that_pins_cores(monkeypatch, cpu, env_example) -> None:
    """The CPU options live in the entrypoint now: a regression there is caught on the model."""
    built = command.kv_transfer_config  # vllm_command()'s own reference

    def pinning(env):
        cfg = built(env)
        if env.get("KIT_KV_ROLE") == "kv_consumer":
            cfg["kv_connector_extra_config"]["cpu_skip_kv_core_pinning"] = False
        return cfg

    monkeypatch.setattr(command, "kv_transfer_config", pinning)
    problems = cc.check_cpu_services(cpu, env_example)
    assert problems == ["decode-cpu: cpu_skip_kv_core_pinning is not true"], problems


# ------------------------------------------------------------------------------ P/D runtime
@pytest.mark.parametrize("model", ["gpu", "cpu", "everything"])
def test_pd_runtime_requirements(request, model) -> None:
    assert cc.check_pd_runtime(request.getfixturevalue(model)) == []


def test_pd_runtime_check_catches_regressions(tmp_path, everything) -> None:
    broken = copy.deepcopy(everything)
    services = broken["services"]
    services["prefill"]["environment"]["VLLM_NIXL_SIDE_CHANNEL_HOST"] = "172.28.0.10"
    services["proxy"]["depends_on"]["decode"]["condition"] = "service_healthy"
    services["proxy-cpu"]["environment"]["PD_PROXY_DECODE_DNS"] = "decode:8300"
    services["decode"]["healthcheck"]["test"][-1] = "print('ok')"
    services["decode-cpu"]["depends_on"].pop("keygen")
    services["decode"]["environment"].pop("UCX_CUDA_IPC_ENABLE_GET_ZCOPY")
    services["prefill-cpu"]["environment"]["UCX_PROTO_EMULATION_ENABLE"] = "n"
    services["decode-cpu"]["environment"].pop("KIT_SLOT_DIR")
    services["prefill"]["environment"]["KIT_KV_TRANSPORT_CHECK"] = "loud"
    services["decode-cpu"]["environment"]["KIT_KV_TRANSPORT_CHECK"] = "warn"
    volumes = services["prefill"]["volumes"]
    services["prefill"]["volumes"] = [v for v in volumes if "huggingface" not in v["target"]]
    problems = cc.check_pd_runtime(broken)
    for needle in (
        "prefill: side-channel host",
        "proxy: must wait",
        "proxy-cpu: PD_PROXY_DECODE_DNS",
        "decode: healthcheck",
        "decode-cpu: does not wait for keygen",
        "decode: UCX_CUDA_IPC_ENABLE_GET_ZCOPY None",
        "prefill-cpu: forces UCX GET settings",
        "decode-cpu: KIT_SLOT_DIR",
        "prefill: KIT_KV_TRANSPORT_CHECK 'loud'",
        "decode-cpu: KIT_KV_TRANSPORT_CHECK set on CPU",
        "prefill: HF cache",
    ):
        assert any(p.startswith(needle) for p in problems), (needle, problems)
    model, _ = render(tmp_path, {"DECODE_NIXL_SIDE_CHANNEL_PORT": "5600"})
    assert any("side-channel port" in p for p in cc.check_pd_runtime(model))


# ------------------------------------------------------------------------------ security
@pytest.mark.parametrize("model", ["gpu", "cpu", "everything", "bare"])
def test_defaults_publish_everything_on_loopback_only(request, model) -> None:
    """Closed by default (both profiles, with .env.example and with no .env at all): the proxy
    too is published on 127.0.0.1 only."""
    compose = request.getfixturevalue(model)
    assert cc.check_exposure(compose) == []
    ports = cc.published(compose)
    assert {host for rows in ports.values() for host, _ in rows} == {cc.LOOPBACK}
    proxies = [n for n in ("proxy", "proxy-cpu") if n in compose["services"]]
    assert proxies and all(ports[n] == [(cc.LOOPBACK, 8000)] for n in proxies)


def test_monitoring_publishes_on_loopback(everything) -> None:
    ports = cc.published(everything)
    assert ports["prometheus"] == [(cc.LOOPBACK, 9090)]
    assert ports["grafana"] == [(cc.LOOPBACK, 3000)]
    for name in ("prefill", "decode", "prefill-cpu", "decode-cpu", "keygen"):
        assert ports[name] == [], name


def test_bind_address_opens_monitoring(tmp_path) -> None:
    model, _ = render(tmp_path, {"BIND_ADDRESS": "0.0.0.0"}, profiles=ALL_PROFILES)
    problems = cc.check_exposure(model)
    assert {p.split(":", 1)[0] for p in problems} == {"prometheus", "grafana"}, problems
    model, _ = render(tmp_path, {"PROXY_BIND_ADDRESS": "0.0.0.0"})
    assert cc.published(model)["proxy"] == [("0.0.0.0", 8000)]
    assert cc.check_exposure(model) == []  # the proxy may; keygen then asks for keys
    keygen = cc.environment(model["services"]["keygen"])
    assert keygen["KIT_PROXY_BIND_ADDRESS"] == "0.0.0.0"


@pytest.mark.parametrize("profiles", [(), ("cpu",)], ids=["gpu", "cpu"])
def test_debug_ports_publish_vllm_on_loopback_only(profiles) -> None:
    model = cli.config(files=[COMPOSE_FILE, DEBUG_PORTS_FILE], profiles=profiles)
    assert cc.check_exposure(model, debug_ports=True) == []
    suffix = "-cpu" if profiles else ""
    ports = cc.published(model)
    assert ports["prefill" + suffix] == [(cc.LOOPBACK, 8100)]
    assert ports["decode" + suffix] == [(cc.LOOPBACK, 8200)]
    # Without the debug allowance the same model is flagged: the check sees the extra ports.
    assert len(cc.check_exposure(model)) == 2


def test_exposure_check_catches_a_public_debug_port(tmp_path) -> None:
    edit = ('"127.0.0.1:${DECODE_PORT', '"${DECODE_PORT')
    debug = cli.edited_copy(tmp_path, [edit], DEBUG_PORTS_FILE)
    model = cli.config(files=[COMPOSE_FILE, debug])
    problems = cc.check_exposure(model, debug_ports=True)
    assert len(problems) == 1, problems
    assert problems[0].startswith("decode: publishes 8200->8200 on every interface"), problems


@pytest.mark.parametrize("model", ["gpu", "cpu", "everything"])
def test_least_privilege(request, model) -> None:
    assert cc.check_least_privilege(request.getfixturevalue(model)) == []


def test_least_privilege_check_catches_regressions(everything) -> None:
    broken = copy.deepcopy(everything)
    services = broken["services"]
    services["proxy"]["read_only"] = False
    services["prometheus"]["cap_drop"] = []
    services["decode"]["security_opt"] = []
    services["prefill"]["cap_add"] = ["SYS_NICE"]
    services["decode-cpu"]["cap_add"] = ["SYS_NICE", "SYS_ADMIN"]
    services["grafana"]["privileged"] = True
    assert sorted(cc.check_least_privilege(broken)) == [
        "decode-cpu: cap_add ['SYS_ADMIN']",
        "decode: no no-new-privileges:true",
        "grafana: privileged",
        "prefill: cap_add ['SYS_NICE']",
        "prometheus: capabilities not dropped (cap_drop ALL)",
        "proxy: root filesystem not read_only",
    ]


@pytest.mark.parametrize("model", ["gpu", "cpu", "everything"])
def test_secrets_are_files(request, model) -> None:
    assert cc.check_secrets(request.getfixturevalue(model)) == []


def test_secret_values_never_reach_the_model(tmp_path) -> None:
    """Secrets set the old way (environment / .env) go nowhere: the rendered model, environment
    included, never carries them."""
    names = ("HF_TOKEN", "GRAFANA_ADMIN_PASSWORD", "GF_SECURITY_ADMIN_PASSWORD", "VLLM_API_KEY")
    names += ("PD_PROXY_API_KEY",)
    overrides = {name: f"sentinel-{name.lower()}" for name in names}
    env_path = cli.env_file(tmp_path, overrides)
    res = cli.run("config", "--format", "json", env_file=env_path, profiles=ALL_PROFILES)
    assert res.returncode == 0, res.stderr
    assert "sentinel-" not in res.stdout


def test_secret_check_catches_regressions(tmp_path, everything) -> None:
    broken = copy.deepcopy(everything)
    services = broken["services"]
    services["prefill"]["environment"]["HF_TOKEN"] = ""
    services["grafana"]["environment"]["GF_SECURITY_ADMIN_PASSWORD"] = "admin"
    services["proxy-cpu"]["environment"]["PD_PROXY_API_KEY"] = "k"
    services["decode"]["secrets"] = []
    services["keygen"]["network_mode"] = "bridge"
    services["proxy"]["volumes"][0]["read_only"] = False
    problems = cc.check_secrets(broken)
    for needle in (
        "prefill: secret-looking environment value HF_TOKEN",
        "grafana: secret-looking environment value GF_SECURITY_ADMIN_PASSWORD",
        "proxy-cpu: secret-looking environment value PD_PROXY_API_KEY",
        "decode: kit_secrets not mounted",
        "keygen: has a network",
        "proxy: kit-keys not mounted read-only",
    ):
        assert needle in problems, (needle, problems)
    model, _ = render(tmp_path, {"GRAFANA_ANONYMOUS": "true"})
    assert cc.check_secrets(model) == ["grafana: anonymous access 'true', want 'false'"]


# ------------------------------------------------------------------------ mounts, builds, images
@pytest.mark.parametrize("model", ["gpu", "cpu"])
def test_connector_mounted_read_only_at_module_path(request, model, env_example) -> None:
    compose = request.getfixturevalue(model)
    assert cc.check_connector_mount(compose, env_example["KV_CONNECTOR_MODULE_PATH"]) == []
    assert cc.check_connector_mount(compose, "no_such_module")
    broken = copy.deepcopy(compose)
    for service in cc.vllm_services(broken).values():
        for mount in cc.bind_mounts(service):
            mount.pop("read_only", None)
    problems = cc.check_connector_mount(broken, env_example["KV_CONNECTOR_MODULE_PATH"])
    assert problems and all("not read-only" in p for p in problems), problems


@pytest.mark.parametrize("base", ["official", "local"])
def test_build_contexts_and_dockerfiles_exist(tmp_path, base) -> None:
    model, _ = render(tmp_path, {"KIT_IMAGE_BASE": base}, profiles=ALL_PROFILES)
    built = {name for name, service in model["services"].items() if service.get("build")}
    assert {"proxy", "proxy-cpu", "prefill-cpu", "prometheus"} <= built
    assert cc.check_builds(model) == []


def test_build_check_catches_a_missing_dockerfile(tmp_path) -> None:
    model, _ = render(tmp_path, {"KIT_IMAGE_BASE": "airgapped"}, profiles=ALL_PROFILES)
    problems = cc.check_builds(model)
    assert {p.split(":", 1)[0] for p in problems} == {"prefill-cpu", "prometheus"}, problems


def test_images_pinned(everything) -> None:
    version = vllm_version()
    assert everything["services"]["prefill"]["image"] == f"vllm/vllm-openai:v{version}"
    assert cc.check_images_pinned(everything, version) == []


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        ({"VLLM_IMAGE": "vllm/vllm-openai:latest"}, "prefill: image 'vllm/vllm-openai:latest'"),
        ({"VLLM_IMAGE": "localhost:5000/vllm/vllm-openai"}, "is not pinned"),
        ({"VLLM_IMAGE": "vllm/vllm-openai:v0.31.0"}, "is not vLLM"),
        ({"KIT_VLLM_CPU_BASE_IMAGE": "vllm/vllm-openai-cpu"}, "build arg BASE_IMAGE"),
        ({"GRAFANA_IMAGE": "grafana/grafana"}, "grafana: image"),
    ],
    ids=["latest", "untagged-registry", "other-vllm", "untagged-base", "grafana"],
)
def test_image_check_catches_unpinned_images(tmp_path, overrides, needle) -> None:
    model, _ = render(tmp_path, overrides, profiles=ALL_PROFILES)
    problems = cc.check_images_pinned(model, vllm_version())
    assert any(needle in p for p in problems), problems
