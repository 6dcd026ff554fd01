import json
from pathlib import Path

import pytest

from pcp_pd_kit.localstack.commands import (
    prefill_cpus_apart_from_decode,
    prefill_rank0_cpus,
    prometheus_spec,
    proxy_spec,
    vllm_server_spec,
)
from tests.support.env import example_settings

REPO = Path("/repo")
SETTINGS = example_settings(
    kv_connector="PcpCanonicalNixlConnector", kv_connector_module_path="pcp_nixl_connector"
)


def _flag(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


@pytest.mark.parametrize(
    ("role", "kv_role"), [("prefill", "kv_producer"), ("decode", "kv_consumer")]
)
def test_pd_servers_get_connector_role_and_cpu_knobs(role: str, kv_role: str) -> None:
    spec = vllm_server_spec(SETTINGS, role, "/m", "tiny", REPO)  # type: ignore[arg-type]
    config = json.loads(_flag(spec.argv, "--kv-transfer-config"))
    assert config["kv_role"] == kv_role
    assert config["kv_connector"] == "PcpCanonicalNixlConnector"
    assert config["kv_connector_module_path"] == "pcp_nixl_connector"
    assert config["kv_buffer_device"] == "cpu"
    assert config["kv_connector_extra_config"] == {
        "cpu_nixl_progress_delay_us": 1000,
        "cpu_skip_kv_core_pinning": True,
        "cpu_early_kv_load": False,
        "kv_lease_duration": 30,
    }
    assert spec.env["PYTHONPATH"] == "/repo/connector"
    assert spec.env["PCP_NIXL_CPU_FIXES"] == "1"
    assert spec.env["UCX_TLS"] == "tcp,self,sm"
    assert spec.env["UCX_NET_DEVICES"] == "lo"
    assert spec.env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.1"
    assert spec.argv[1:3] == ["-m", "vllm.entrypoints.launchers.api_server.entry"]


def test_extra_connectors_wrap_both_servers_kit_connector_first() -> None:
    import dataclasses

    extra = [{"kv_connector": "ExampleConnector", "kv_role": "kv_both"}]
    wrapped = dataclasses.replace(SETTINGS, kv_extra_connectors=json.dumps(extra))
    for role, kv_role in (("prefill", "kv_producer"), ("decode", "kv_consumer")):
        alone = json.loads(
            _flag(vllm_server_spec(SETTINGS, role, "/m", "t", REPO).argv, "--kv-transfer-config")
        )
        spec = vllm_server_spec(wrapped, role, "/m", "t", REPO)  # type: ignore[arg-type]
        config = json.loads(_flag(spec.argv, "--kv-transfer-config"))
        assert config["kv_connector"] == "MultiConnector" and config["kv_role"] == kv_role
        kit, example = config["kv_connector_extra_config"]["connectors"]
        assert kit["kv_connector"] == alone["kv_connector"]
        assert kit["kv_connector_extra_config"] == {
            **alone["kv_connector_extra_config"],
            "pcp_completion_mode": "world_size",
        }
        assert example == extra[0]


def test_prefill_and_decode_differ_in_port_binding_and_side_channel() -> None:
    p = vllm_server_spec(SETTINGS, "prefill", "/m", "tiny", REPO)
    d = vllm_server_spec(SETTINGS, "decode", "/m", "tiny", REPO)
    # .env.example: a PCP2 prefill with a rank on each core, the decode beside rank 1 on core 1.
    assert (p.env["VLLM_CPU_OMP_THREADS_BIND"], d.env["VLLM_CPU_OMP_THREADS_BIND"]) == ("0|1", "1")
    wide = vllm_server_spec(example_settings(prefill_cpus="2-5"), "prefill", "/m", "t", REPO)
    assert wide.env["VLLM_CPU_OMP_THREADS_BIND"] == "2,3|4,5"
    assert p.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] != d.env["VLLM_NIXL_SIDE_CHANNEL_PORT"]
    assert _flag(p.argv, "--port") != _flag(d.argv, "--port")
    assert p.health_url == "http://127.0.0.1:18100/health"


def test_stock_connector_has_no_module_path() -> None:
    stock = example_settings(kv_connector="NixlConnector", kv_connector_module_path="")
    spec = vllm_server_spec(stock, "decode", "/m", "tiny", REPO)
    config = json.loads(_flag(spec.argv, "--kv-transfer-config"))
    assert config["kv_connector"] == "NixlConnector"
    assert "kv_connector_module_path" not in config


def test_reference_server_is_not_disaggregated() -> None:
    spec = vllm_server_spec(SETTINGS, "reference", "/m", "tiny", REPO)
    assert "--kv-transfer-config" not in spec.argv
    assert "VLLM_NIXL_SIDE_CHANNEL_PORT" not in spec.env
    # One plain instance: no PCP, but the same CPU fixes (its answers are the reference).
    assert "--prefill-context-parallel-size" not in spec.argv
    assert (
        spec.env["PCP_NIXL_CPU_FIXES"] == "1" and "PCP_NIXL_CPU_TRITON_INTERPRETER" not in spec.env
    )
    assert spec.env["VLLM_CPU_OMP_THREADS_BIND"] == "0"  # prefill rank 0's cores
    # Alone on the host it keeps vLLM's spinning wait; the P/D pair's servers sleep instead.
    assert "PCP_NIXL_CPU_SLEEPING_WAIT" not in spec.env
    for role in ("prefill", "decode"):
        assert (
            vllm_server_spec(SETTINGS, role, "/m", "t", REPO).env["PCP_NIXL_CPU_SLEEPING_WAIT"]
            == "1"
        )
    wide = vllm_server_spec(example_settings(prefill_cpus="0-3"), "reference", "/m", "t", REPO)
    assert wide.env["VLLM_CPU_OMP_THREADS_BIND"] == "0,1"
    assert spec.env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert _flag(spec.argv, "--port") == "18300"


@pytest.mark.parametrize(
    ("prefill_cpus", "want"), [("0", "0"), ("0,1", "0"), ("0-3", "0,1"), ("2-5", "2,3")]
)
def test_a_server_beside_the_prefill_gets_rank_0s_cores(prefill_cpus: str, want: str) -> None:
    # The reference and the cache bench's second decode: one thread per core group, never two
    # threads across the two ranks' cores.
    assert prefill_rank0_cpus(example_settings(prefill_cpus=prefill_cpus)) == want
    spec = vllm_server_spec(example_settings(prefill_cpus=prefill_cpus), "reference", "/m", "t",
                            REPO)  # fmt: skip
    assert spec.env["VLLM_CPU_OMP_THREADS_BIND"] == want


@pytest.mark.parametrize(
    ("prefill_cpus", "decode_cpus", "want"),
    [
        ("0,1", "1", "0"),  # 2 cores: core 0, both ranks taking turns on it
        ("0-3", "4-5", "0,1,2,3"),  # nothing shared: all of them
        ("0-3", "3", "0,1"),  # three left cannot split over two ranks: rank 0's
        ("1", "1", "1"),  # nothing left: rank 0's, shared as before
    ],
)
def test_a_stock_prefill_keeps_off_the_decodes_cores(
    prefill_cpus: str, decode_cpus: str, want: str
) -> None:
    settings = example_settings(prefill_cpus=prefill_cpus, decode_cpus=decode_cpus)
    assert prefill_cpus_apart_from_decode(settings) == want


def test_prefill_runs_the_mission_topology_decode_stays_pcp1() -> None:
    p = vllm_server_spec(SETTINGS, "prefill", "/m", "tiny", REPO)
    d = vllm_server_spec(SETTINGS, "decode", "/m", "tiny", REPO)
    assert _flag(p.argv, "--prefill-context-parallel-size") == "2"
    assert "--enable-expert-parallel" in p.argv
    assert p.env["PCP_NIXL_CPU_TRITON_INTERPRETER"] == "1"
    assert (
        "--prefill-context-parallel-size" not in d.argv and "--enable-expert-parallel" not in d.argv
    )
    assert "PCP_NIXL_CPU_TRITON_INTERPRETER" not in d.env
    for spec in (p, d):
        assert _flag(spec.argv, "--attention-backend") == "CPU_MLA"
        assert _flag(spec.argv, "--dtype") == "float32"
        assert _flag(spec.argv, "--block-size") == "16"


def test_pcp1_prefill_without_ep_flags() -> None:
    pcp1 = example_settings(prefill_pcp_size=1, prefill_cpus="0")
    spec = vllm_server_spec(pcp1, "prefill", "/m", "tiny", REPO)
    assert "--prefill-context-parallel-size" not in spec.argv
    assert "--enable-expert-parallel" not in spec.argv
    assert spec.env["VLLM_CPU_OMP_THREADS_BIND"] == "0"


def test_block_size_and_eager_follow_settings() -> None:
    eager = vllm_server_spec(example_settings(block_size=64), "prefill", "/m", "t", REPO)
    compiled = vllm_server_spec(example_settings(enforce_eager=False), "prefill", "/m", "t", REPO)
    assert _flag(eager.argv, "--block-size") == "64"
    assert "--enforce-eager" in eager.argv
    assert "--enforce-eager" not in compiled.argv


@pytest.mark.parametrize("role", ["prefill", "decode", "reference"])
def test_prefix_caching_follows_its_one_knob_on_every_server(role: str) -> None:
    """On by default (.env.example); PREFIX_CACHING=false turns it off; one switch either way."""
    on = vllm_server_spec(example_settings(), role, "/m", "t", REPO).argv  # type: ignore[arg-type]
    off = vllm_server_spec(example_settings(prefix_caching=False), role, "/m", "t", REPO).argv  # type: ignore[arg-type]
    assert "--enable-prefix-caching" in on and "--no-enable-prefix-caching" not in on
    assert "--no-enable-prefix-caching" in off and "--enable-prefix-caching" not in off


@pytest.mark.parametrize(("role", "port"), [("prefill", 18102), ("decode", 18202)])
def test_kv_events_bound_on_loopback_while_caching_is_on(role: str, port: int) -> None:
    """A PUB and a replay port on LOCAL_HOST, written so that vLLM binds them (not "*": every
    prompt's token ids on every interface); none with PREFIX_CACHING off, none on the
    reference."""
    on = vllm_server_spec(example_settings(), role, "/m", "t", REPO)  # type: ignore[arg-type]
    config = json.loads(_flag(on.argv, "--kv-events-config"))
    assert config["enable_kv_cache_events"] is True and config["publisher"] == "zmq"
    assert config["endpoint"] == f"tcp://[::ffff:127.0.0.1]:{port}"
    assert config["replay_endpoint"] == f"tcp://[::ffff:127.0.0.1]:{port + 1}"
    settings = example_settings(prefix_caching=False, prefix_cache_routing="off")
    off = vllm_server_spec(settings, role, "/m", "t", REPO)  # type: ignore[arg-type]
    assert "--kv-events-config" not in off.argv
    reference = vllm_server_spec(example_settings(), "reference", "/m", "t", REPO)
    assert "--kv-events-config" not in reference.argv


def test_proxy_routes_by_cache_with_the_models_tokenizer() -> None:
    settings = example_settings(prefix_cache_routing="events")
    argv = proxy_spec(settings, tokenizer="/models/tiny").argv
    assert _flag(argv, "--prefix-cache-routing") == "events"
    assert _flag(argv, "--tokenizer") == "/models/tiny"
    assert "--tokenizer" not in proxy_spec(settings).argv
    uncached = example_settings(prefix_caching=False, prefix_cache_routing="auto")
    assert _flag(proxy_spec(uncached).argv, "--prefix-cache-routing") == "off"


def test_proxy_points_at_the_pair() -> None:
    argv = proxy_spec(example_settings(proxy_port=18001)).argv
    assert argv[1:3] == ["-m", "pd_proxy"]
    assert _flag(argv, "--prefill") == "http://127.0.0.1:18100"
    assert _flag(argv, "--decode") == "http://127.0.0.1:18200"
    assert _flag(argv, "--port") == "18001"


def test_prometheus_listens_on_its_port() -> None:
    spec = prometheus_spec(example_settings(), Path("/c.yml"), Path("/d"), "/usr/bin/prometheus")
    assert "--web.listen-address=127.0.0.1:18090" in spec.argv
    assert "--config.file=/c.yml" in spec.argv
    assert spec.health_url.endswith("/-/ready")
