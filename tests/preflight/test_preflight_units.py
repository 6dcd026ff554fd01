"""Unit tests of the small pure modules: model size, nvidia-smi parsing, CUDA tags, MoE rules,
network ranges, settings, the HF cache, reports and the command runner."""

from __future__ import annotations

import ast
import importlib.util
import json
import time
from pathlib import Path

import pytest

from pcp_pd_kit.preflight import cuda, gpus, hfcache, moe, network, proc, report, settings, weights
from tests.preflight.fake_host import DSV2_LITE_CONFIG, cache_model


# -- weights --------------------------------------------------------------------------------------
def test_deepseek_v2_lite_counts_to_its_published_size() -> None:
    size = weights.estimate(DSV2_LITE_CONFIG)
    assert size is not None
    assert abs(size.total_params - 15.7e9) / 15.7e9 < 0.005  # the model card says 15.7 B
    assert size.expert_params == 26 * 64 * 3 * 2048 * 1408  # MoE layers x experts x 3 matrices
    assert size.kv_bytes_per_token == 27 * (512 + 64) * 2 and not size.kv_split_by_tp
    assert weights.from_table("DEEPSEEK-AI/DeepSeek-V2-Lite") == size


def test_dense_gqa_model() -> None:
    size = weights.from_table("Qwen/Qwen2.5-0.5B-Instruct")
    assert size is not None and not size.is_moe
    assert abs(size.total_params - 0.494e9) / 0.494e9 < 0.01  # published: 0.49 B
    assert size.kv_bytes_per_token == 24 * 2 * 2 * 64 * 2 and size.kv_split_by_tp


@pytest.mark.parametrize(
    "change",
    [{"quantization_config": {"quant_method": "fp8"}}, {"torch_dtype": "int8"},
     {"hidden_size": None}, {"num_hidden_layers": "many"}],
)  # fmt: skip
def test_configs_it_cannot_count(change: dict) -> None:
    assert weights.estimate({**DSV2_LITE_CONFIG, **change}) is None


def test_float32_checkpoints_count_as_16_bit() -> None:
    size = weights.estimate({**DSV2_LITE_CONFIG, "torch_dtype": "float32"})
    assert size is not None and size.bytes_per_param == 2


# -- nvidia-smi -----------------------------------------------------------------------------------
INVENTORY = """\
0, GPU-0aa, NVIDIA H100 80GB HBM3, 81559, 9.0, 580.95.05
1, GPU-1BB, NVIDIA GH200 480GB, [N/A], 9.0, 580.95.05
"""


def test_parse_inventory() -> None:
    first, second = gpus.parse_inventory(INVENTORY)
    assert (first.index, first.memory_mib, first.compute_cap, first.driver) == (
        0, 81559, (9, 0), "580.95.05")  # fmt: skip
    assert second.memory_mib is None and second.sm == "SM 9.0"
    assert gpus.resolve("1", [first, second]) is second
    assert gpus.resolve("gpu-1bb", [first, second]) is second
    assert gpus.resolve("GPU-1", [first, second]) is None  # no UUID prefixes
    assert gpus.describe("GPU-0aa", first) == "GPU-0aa = GPU 0 (NVIDIA H100 80GB HBM3)"


def test_parse_inventory_rejects_other_output() -> None:
    with pytest.raises(ValueError):
        gpus.parse_inventory("0, NVIDIA H100\n")


# -- CUDA -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("image", "expected"),
    [
        ("vllm/vllm-openai:v0.32.0", (13, 0)),
        ("docker.io/vllm/vllm-openai:v0.33.1", (13, 0)),
        ("vllm/vllm-openai:v0.32.0-cu129", (12, 9)),
        ("registry.local:5000/vllm:cu128", (12, 8)),
        ("vllm/vllm-openai:v0.31.0", None),
        ("vllm/vllm-openai:nightly", None),
        ("vllm/vllm-openai", None),
        ("registry.local:5000/vllm/vllm-openai:v0.32.0", None),
        ("acme/cuber:v1", None),
    ],
)
def test_cuda_from_tag(image: str, expected) -> None:
    assert cuda.from_tag(image) == expected


def test_cuda_from_image_env_and_drivers() -> None:
    assert cuda.from_image_env(["PATH=/bin", "CUDA_VERSION=12.9.1"]) == (12, 9)
    assert cuda.from_image_env(["PATH=/bin"]) is None
    assert cuda.min_driver((12, 8)) == "570.26" and cuda.min_driver((12, 7)) is None
    assert cuda.driver_at_least("580.65.06", "580.65.06")
    assert not cuda.driver_at_least("580.9", "580.65.06")
    assert cuda.driver_at_least("590.1", "580.65.06")


# -- MoE rules ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("backend", "cap", "runs"),
    [
        ("flashinfer_cutlass", (9, 0), True), ("flashinfer_cutlass", (10, 0), True),
        ("flashinfer_cutlass", (12, 0), True), ("flashinfer_cutlass", (11, 0), False),
        ("flashinfer_cutlass", (8, 9), False), ("flashinfer_cutlass", (8, 0), False),
        ("flashinfer_trtllm", (10, 3), True), ("flashinfer_trtllm", (9, 0), False),
        ("triton", (8, 0), True), ("aiter", (9, 0), False),
    ],
)  # fmt: skip
def test_backend_compute_capability(backend: str, cap, runs: bool) -> None:
    assert moe.runs_on(backend, cap) is runs


def test_auto_choice() -> None:
    assert [moe.auto_choice(c) for c in [(8, 0), (9, 0), (10, 0), (12, 0)]] == [
        "triton", "triton", "flashinfer_trtllm", "flashinfer_cutlass"]  # fmt: skip
    assert moe.normalize(" FlashInfer-CUTLASS ") == "flashinfer_cutlass"


def _vllm_file(relative: str) -> Path:
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("vLLM is not installed in this environment (pip install -e '.[cpu]')")
    return Path(next(iter(spec.submodule_search_locations))) / relative


def test_backend_names_match_the_installed_vllm() -> None:
    """moe.BACKENDS is vllm/config/kernel.py's MoEBackend Literal, read from the source."""
    tree = ast.parse(_vllm_file("config/kernel.py").read_text())
    literal = next(
        node.value for node in ast.walk(tree)
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "MoEBackend"
    )  # fmt: skip
    names = tuple(elt.value for elt in literal.slice.elts)  # type: ignore[attr-defined]
    assert names == moe.BACKENDS


def test_unquantized_backends_match_the_installed_vllm() -> None:
    source = _vllm_file("model_executor/layers/fused_moe/oracle/unquantized.py").read_text()
    tree = ast.parse(source)
    function = next(
        n for n in ast.walk(tree)
        if isinstance(n, ast.FunctionDef) and n.name == "map_unquantized_backend"
    )  # fmt: skip
    mapping = next(n for n in ast.walk(function) if isinstance(n, ast.Dict))
    assert tuple(key.value for key in mapping.keys) == moe.UNQUANTIZED  # type: ignore[union-attr]


# -- network --------------------------------------------------------------------------------------
PROC_ROUTE = """\
Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT
eth0\t00000000\t010200C0\t0003\t0\t0\t0\t00000000\t0\t0\t0
docker0\t000011AC\t00000000\t0001\t0\t0\t0\t0000FFFF\t0\t0\t0
eth0\t000200C0\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0
"""


def test_routes_from_proc_and_ip_agree() -> None:
    from_proc = network.proc_routes(PROC_ROUTE)
    from_ip = network.ip_routes(json.dumps([
        {"dst": "default", "dev": "eth0"}, {"dst": "172.17.0.0/16", "dev": "docker0"},
        {"dst": "192.0.2.0/24", "dev": "eth0"}]))  # fmt: skip
    assert [(str(t.net), t.dev) for t in from_proc] == [("172.17.0.0/16", "docker0"),
                                                        ("192.0.2.0/24", "eth0")]  # fmt: skip
    assert from_proc == from_ip


def test_docker_networks_leave_out_the_project() -> None:
    inspect = json.dumps([
        {"Name": "bridge", "Id": "a" * 64, "Options": {"com.docker.network.bridge.name": "docker0"},
         "IPAM": {"Config": [{"Subnet": "172.17.0.0/16"}]}},
        {"Name": "kit_pd", "Id": "b" * 64, "Labels": {"com.docker.compose.project": "kit"},
         "IPAM": {"Config": [{"Subnet": "172.28.0.0/24"}]}},
    ])  # fmt: skip
    taken, own = network.docker_networks(inspect, "kit")
    assert [(str(t.net), t.dev) for t in taken] == [("172.17.0.0/16", "docker0")]
    assert own == {"br-" + "b" * 12}
    subnet = settings.ipaddress.ip_network("172.17.5.0/24")
    routes = network.proc_routes(PROC_ROUTE) + network.ip_routes(
        '[{"dst": "172.16.0.0/12", "dev": "wg0"}]'
    )
    hits = network.overlaps(subnet, taken + routes, own)  # docker0's own route is not repeated
    assert [h.what for h in hits] == ["Docker network 'bridge'", "host route on wg0"]
    alt = network.free_alternative(subnet, taken, own)
    assert alt is not None and not alt.overlaps(taken[0].net)


# -- settings -------------------------------------------------------------------------------------
def test_parse_config_and_gpu_services(tmp_path: Path) -> None:
    block = {key: "1" for key in settings.REQUIRED}
    block.update(hf_cache_dir="~/hf", hf_token_file="./secrets/t", prefill_gpus=" 0, ,GPU-x ")
    view = settings.parse_config(json.dumps({
        "name": "kit", "x-kit-settings": block,
        "services": {"a": {"gpus": "all"}, "b": {"image": "x"},
                     "c": {"deploy": {"resources": {"reservations": {"devices": [
                         {"capabilities": ["gpu"]}]}}}}},
    }))  # fmt: skip
    assert settings.gpu_services(view) == ["a", "c"]
    s = settings.Settings(view.settings, tmp_path, ".env")
    assert s.id_list("prefill_gpus") == ["0", "GPU-x"]
    assert s.path("hf_cache_dir") == Path.home() / "hf"
    assert s.path("hf_token_file") == tmp_path / "secrets" / "t"
    with pytest.raises(settings.SettingsError, match="PROXY_PORT='1x'"):
        settings.Settings({"proxy_port": "1x"}, tmp_path, ".env").port("proxy_port")


def test_parse_config_needs_json_and_the_block() -> None:
    with pytest.raises(settings.SettingsError, match="printed no JSON"):
        settings.parse_config("services:\n  a: {}\n")
    with pytest.raises(settings.SettingsError, match="lacks model_name"):
        settings.parse_config(json.dumps({"x-kit-settings": {"vllm_image": "x"}}))


# -- HF cache -------------------------------------------------------------------------------------
def test_hf_cache(tmp_path: Path) -> None:
    cache_model(tmp_path, "org/m", {"a": 1}, blob_bytes=1000)
    (tmp_path / "hub/models--org--m/blobs/part.incomplete").write_bytes(b"x" * 50)
    assert hfcache.cached_bytes(tmp_path, "org/m") == 1000
    assert hfcache.cached_config(tmp_path, "org/m") is not None
    assert hfcache.cached_config(tmp_path, "org/other") is None
    assert hfcache.is_gated("meta-llama/Llama-3.1-8B") and not hfcache.is_gated("Qwen/Qwen3-8B")
    token = tmp_path / "token"
    token.write_text(" \n")
    assert not hfcache.token_present(token) and not hfcache.token_present(tmp_path / "none")
    token.write_text("hf_x\n")
    assert hfcache.token_present(token)


# -- report and runner ----------------------------------------------------------------------------
def test_exit_status_is_capped() -> None:
    many = [report.fail("x", "bad: fix.")] * 150 + [report.warn("y", "meh")]
    assert report.exit_status(many) == 100
    assert report.exit_status([report.ok("x", "fine")]) == 0
    text = report.render_text([report.ok("x", "fine"), report.warn("y", "meh")], "go")
    assert text.splitlines() == ["ok    fine", "WARN  meh", "", "all checks passed: go"]


def test_runner_bounds_time_and_reports_missing_commands(tmp_path: Path) -> None:
    started = time.monotonic()
    slow = proc.run(["bash", "-c", "sleep 30 & sleep 30"], timeout=0.5)
    assert slow.timed_out and not slow.ok and time.monotonic() - started < 10
    missing = proc.run([str(tmp_path / "nope")], timeout=5)
    assert missing.missing and not missing.ok
    failed = proc.run(["bash", "-c", "echo first >&2; echo 'the reason' >&2; exit 3"], timeout=5)
    assert failed.returncode == 3 and failed.detail() == "the reason"
