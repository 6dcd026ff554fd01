"""The GPU checks end to end on a fake host: count and ids (indices and UUIDs), MoE backend vs
compute capability, memory fractions, and the driver vs the image's CUDA."""

from __future__ import annotations

import pytest

from tests.preflight.fake_host import (
    A100,
    H100,
    H200,
    L4,
    L40S,
    FakeHost,
    cache_model,
    consistent,
    gpu_rows,
    uuid_of,
)


# -- count and ids --------------------------------------------------------------------------------
def test_too_few_gpus(host: FakeHost) -> None:
    host.gpus = gpu_rows(H100, H100)
    out = consistent(host.run())
    assert "found 2 GPU(s) but prefill needs" in out.text("gpus")
    assert "DECODE_GPUS names GPU '2', which nvidia-smi does not list (it lists 0, 1)" in out.text(
        "gpu-ids"
    )


def test_nvidia_smi_failure(host: FakeHost) -> None:
    host.gpus = None
    out = consistent(host.run())
    assert out.status("gpus") == ["FAIL"]
    assert "the NVIDIA driver is not working" in out.text("gpus")


def test_nvidia_smi_odd_output(host: FakeHost) -> None:
    host.gpus = ['Field "compute_cap" is not a valid field to query.']
    out = consistent(host.run())
    assert "nvidia-smi answered the GPU query oddly" in out.text("gpus")


@pytest.mark.parametrize(
    ("settings", "needle"),
    [
        ({"prefill_gpus": "0"}, "PREFILL_GPUS lists 1 GPU(s) (0) but PREFILL_REPLICAS x GPUs per "
                                "replica (PREFILLER_TP_SIZE x PREFILLER_PCP_SIZE) = 1 x 2 = 2: "
                                "list exactly 2 GPU id(s) in PREFILL_GPUS, in .env."),
        ({"decode_gpus": "2,0"}, "DECODE_GPUS lists 2 GPU(s) (2, 0) but DECODE_REPLICAS x GPUs per "
                                 "replica (DECODER_TP_SIZE) = 1 x 1 = 1"),
        ({"decode_gpus": "1"}, "GPU 1 is given to both PREFILL_GPUS and DECODE_GPUS"),
        ({"decode_gpus": "7"}, "DECODE_GPUS names GPU '7', which nvidia-smi does not list"),
        ({"prefill_gpus": "0,0"}, "GPU 0 (NVIDIA H100 80GB HBM3) appears twice in PREFILL_GPUS"),
        ({"decode_gpus": "GPU-nope"}, "DECODE_GPUS names GPU 'GPU-nope'"),
        ({"prefill_pcp_size": "4"}, "found 3 GPU(s) but prefill needs"),
    ],
)  # fmt: skip
def test_gpu_id_failures(host: FakeHost, settings: dict[str, str], needle: str) -> None:
    host.settings.update(settings)
    out = consistent(host.run())
    assert needle in out.text("gpus") + out.text("gpu-ids"), out.dump()


def test_uuids_are_accepted_and_reported_by_index_and_name(host: FakeHost) -> None:
    host.gpus = gpu_rows(H100, H100, H200)
    host.settings.update(prefill_gpus=f"{uuid_of(1)}, 0", decode_gpus=uuid_of(2).lower())
    out = consistent(host.run())
    assert out.returncode == 0, out.dump()
    placed = out.text("gpu-ids")
    assert f"{uuid_of(1)} = GPU 1 (NVIDIA H100 80GB HBM3)" in placed
    assert f"{uuid_of(2).lower()} = GPU 2 (NVIDIA H200)" in placed
    assert "decode fits" in out.text("memory") and "GPU 2 (NVIDIA H200)'s 143771 MiB" in out.text(
        "memory"
    )


def test_same_gpu_by_index_and_uuid_is_caught(host: FakeHost) -> None:
    host.settings.update(decode_gpus=uuid_of(0))
    out = consistent(host.run())
    assert "GPU 0 is given to both PREFILL_GPUS and DECODE_GPUS" in out.text("gpu-ids")


# -- xPyD: several replicas per role --------------------------------------------------------------
XPYD = {"prefill_replicas": "2", "decode_replicas": "2", "prefill_gpus": "0,1,2,3",
        "decode_gpus": "4,5"}  # fmt: skip


PREFILL_LENGTH = (
    "PREFILL_GPUS lists 3 GPU(s) (0, 1, 2) but PREFILL_REPLICAS x GPUs per replica "
    "(PREFILLER_TP_SIZE x PREFILLER_PCP_SIZE) = 2 x 2 = 4: list exactly 4 GPU id(s) in "
    "PREFILL_GPUS (replica 1 takes the first 2, replica 2 the next, ...), in .env, or change "
    "PREFILL_REPLICAS (each prefill replica takes PREFILLER_TP_SIZE x PREFILLER_PCP_SIZE GPUs)."
)


def test_2p2d_on_8_gpus_prints_each_replicas_gpus(host: FakeHost) -> None:
    host.gpus = gpu_rows(*[H100] * 8)
    host.settings.update(XPYD)
    out = consistent(host.run())
    assert out.returncode == 0, out.dump()
    assert out.text("gpus") == "8 GPU(s) for 6 needed (prefill 2 x (1 x 2), decode 2 x (1))"
    h100 = "(NVIDIA H100 80GB HBM3)"
    assert out.text("gpu-ids") == (
        f"prefill-1: GPU 0 {h100}, GPU 1 {h100}; prefill-2: GPU 2 {h100}, GPU 3 {h100}; "
        f"decode-1: GPU 4 {h100}; decode-2: GPU 5 {h100}"
    )


def test_1p1d_prints_one_replica_per_role(host: FakeHost) -> None:
    out = consistent(host.run())
    assert out.text("gpu-ids").startswith("prefill-1: GPU 0 (NVIDIA H100 80GB HBM3), GPU 1 ")
    assert "; decode-1: GPU 2 (NVIDIA H100 80GB HBM3)" in out.text("gpu-ids")


def test_3p2d_uses_all_8_gpus(host: FakeHost) -> None:
    host.gpus = gpu_rows(*[H200] * 8)
    host.settings.update(prefill_replicas="3", decode_replicas="2", prefill_gpus="0,1,2,3,4,5",
                         decode_gpus="6,7")  # fmt: skip
    out = consistent(host.run())
    assert out.returncode == 0, out.dump()
    assert "8 GPU(s) for 8 needed" in out.text("gpus")
    assert "prefill-3: GPU 4 (NVIDIA H200), GPU 5 (NVIDIA H200); decode-1: GPU 6" in out.text(
        "gpu-ids"
    )


def test_too_few_gpus_for_the_replicas(host: FakeHost) -> None:
    host.gpus = gpu_rows(*[H100] * 4)
    host.settings.update(XPYD)
    out = consistent(host.run())
    assert out.status("gpus") == ["FAIL"]
    assert out.text("gpus") == (
        "found 4 GPU(s) but prefill needs PREFILL_REPLICAS x PREFILLER_TP_SIZE x "
        "PREFILLER_PCP_SIZE = 2 x 1 x 2 = 4 and decode needs DECODE_REPLICAS x DECODER_TP_SIZE "
        "= 2 x 1 = 2, 6 in all: use a bigger host or lower those sizes or replica counts in .env."
    )


@pytest.mark.parametrize(
    ("settings", "needle"),
    [
        ({"decode_gpus": "3,4"}, "GPU 3 is given to both PREFILL_GPUS and DECODE_GPUS"),
        ({"prefill_gpus": "0,1,2,0"}, "GPU 0 (NVIDIA H100 80GB HBM3) appears twice in "
                                      "PREFILL_GPUS"),
        ({"prefill_gpus": "0,1,2"}, PREFILL_LENGTH),
        ({"decode_gpus": "4"}, "DECODE_GPUS lists 1 GPU(s) (4) but DECODE_REPLICAS x GPUs per "
                               "replica (DECODER_TP_SIZE) = 2 x 1 = 2"),
        ({"decode_replicas": "0"}, "DECODE_REPLICAS='0' is not a positive integer"),
    ],
    ids=["overlap", "twice", "prefill-length", "decode-length", "zero-replicas"],
)  # fmt: skip
def test_xpyd_refusals(host: FakeHost, settings: dict[str, str], needle: str) -> None:
    host.gpus = gpu_rows(*[H100] * 8)
    host.settings.update({**XPYD, **settings})
    out = consistent(host.run())
    assert out.returncode != 0
    assert needle in out.text("gpus") + out.text("gpu-ids"), out.dump()


def test_parallel_flags_in_extra_args_are_caught(host: FakeHost) -> None:
    """The entrypoint counts the flags the container really gets: a -pp in VLLM_EXTRA_ARGS
    would make each replica want more GPUs than the lists give it."""
    flags = ["--tensor-parallel-size", "1", "--prefill-context-parallel-size", "2"]
    host.services["prefill"]["command"] = [*flags, "--max-num-seqs", "8"]
    assert consistent(host.run()).status("gpu-ids") == ["ok"]
    host.services["prefill"]["command"] = [*flags, "-pp", "2"]
    out = consistent(host.run())
    assert out.text("gpu-ids") == (
        "the prefill service's vLLM flags give 4 GPU(s) per replica (TP x PCP x PP) but "
        "PREFILLER_TP_SIZE x PREFILLER_PCP_SIZE = 2: set the parallel sizes with "
        "PREFILLER_TP_SIZE x PREFILLER_PCP_SIZE only, not in VLLM_EXTRA_ARGS, in .env."
    )


# -- MoE backend ----------------------------------------------------------------------------------
@pytest.mark.parametrize(("gpu", "sm"), [(A100, "SM 8.0"), (L40S, "SM 8.9")])
def test_flashinfer_cutlass_fails_before_hopper(host: FakeHost, gpu, sm: str) -> None:
    host.gpus = gpu_rows(gpu, gpu, gpu)
    host.settings.update(moe_backend="flashinfer_cutlass")
    out = consistent(host.run())
    text = out.text("moe-backend")
    assert out.status("moe-backend") == ["FAIL"]
    assert f"needs SM 9.0, 10.x or 12.x for bf16 MoE, but GPU 0 ({gpu[0]}) is {sm}" in text
    assert text.endswith("set MOE_BACKEND=auto in .env.")


def test_flashinfer_cutlass_runs_on_hopper(host: FakeHost) -> None:
    host.settings.update(moe_backend="FlashInfer-Cutlass")  # vLLM normalises case and dashes
    out = consistent(host.run())
    assert out.status("moe-backend") == ["ok"]
    assert "MOE_BACKEND=flashinfer_cutlass runs on every assigned GPU (SM 9.0)" in out.text(
        "moe-backend"
    )


def test_auto_on_hopper_mentions_flashinfer_cutlass(host: FakeHost) -> None:
    text = consistent(host.run()).text("moe-backend")
    assert "flashinfer_cutlass also runs on these GPUs" in text
    assert "MOE_BACKEND=flashinfer_cutlass" in text


def test_auto_on_ampere_does_not_offer_flashinfer(host: FakeHost) -> None:
    host.gpus = gpu_rows(A100, A100, A100)
    out = consistent(host.run())
    assert out.status("moe-backend") == ["ok"]
    assert "triton on SM 8.0" in out.text("moe-backend")
    assert "flashinfer_cutlass also runs" not in out.text("moe-backend")


def test_unknown_backend_lists_the_valid_ones(host: FakeHost) -> None:
    host.settings.update(moe_backend="fastest")
    text = consistent(host.run()).text("moe-backend")
    assert "MOE_BACKEND='fastest' is not a moe_backend of vLLM 0.32.0" in text
    assert "auto, triton, batched_triton, deep_gemm" in text and "rdna3." in text


def test_quantized_only_backend_fails_for_a_bf16_model(host: FakeHost) -> None:
    host.settings.update(moe_backend="deep_gemm")
    text = consistent(host.run()).text("moe-backend")
    assert "not accepted for an unquantized (bf16) MoE model" in text
    assert "set MOE_BACKEND=auto" in text


# -- memory ---------------------------------------------------------------------------------------
def test_decode_fraction_too_small_prints_the_one_to_set(host: FakeHost) -> None:
    host.settings.update(decode_gpu_memory_utilization="0.3")
    out = consistent(host.run())
    assert out.status("memory") == ["ok", "FAIL"]
    fail = out.of("memory")[1]["message"]
    assert fail.startswith("decode needs >= 0.46 of GPU 2 (NVIDIA H100 80GB HBM3)'s 81559 MiB "
                           "for 31.4 GB of weights + 3 GiB runtime + 4 GiB KV")  # fmt: skip
    assert fail.endswith("but DECODE_GPU_MEMORY_UTILIZATION=0.3: set "
                         "DECODE_GPU_MEMORY_UTILIZATION=0.50 in .env.")  # fmt: skip


def test_prefill_on_l40s_needs_more_than_half(host: FakeHost) -> None:
    host.gpus = gpu_rows(L40S, L40S, H100)
    host.settings.update(prefill_gpu_memory_utilization="0.5", moe_backend="triton")
    out = consistent(host.run())
    assert "prefill needs >= 0.51 of GPU 0 (NVIDIA L40S)'s 46068 MiB for 17.0 GB" in out.text(
        "memory"
    )
    assert "set PREFILL_GPU_MEMORY_UTILIZATION=0.55" in out.text("memory")


def test_model_that_does_not_fit_at_this_tp(host: FakeHost) -> None:
    host.gpus = gpu_rows(H100, H100, L4)
    host.settings.update(moe_backend="triton")
    text = consistent(host.run()).text("memory")
    assert "does not fit GPU 2 (NVIDIA L4) at this TP" in text
    assert "more than 0.95: raise DECODER_TP_SIZE" in text


def test_memory_uses_the_smallest_gpu_of_a_server(host: FakeHost) -> None:
    host.gpus = gpu_rows(H200, L40S, H200)
    host.settings.update(prefill_gpu_memory_utilization="0.45", moe_backend="triton")
    assert "GPU 1 (NVIDIA L40S)" in consistent(host.run()).text("memory")


def test_tensor_parallel_decode_splits_the_weights(host: FakeHost) -> None:
    host.gpus = gpu_rows(L40S, L40S, L40S, L40S)
    host.settings.update(decode_tp_size="2", decode_gpus="2,3", moe_backend="triton")
    out = consistent(host.run())
    assert out.status("memory") == ["ok", "ok"], out.dump()
    assert "15.7 GB of weights" in out.of("memory")[1]["message"]


def test_unknown_model_size_is_a_warning(host: FakeHost) -> None:
    host.settings.update(model_name="acme/mystery-7b")
    out = consistent(host.run())
    assert out.status("memory") == ["WARN"]
    assert "could not estimate the size of acme/mystery-7b" in out.text("memory")


def test_size_comes_from_the_cached_config(host: FakeHost) -> None:
    config = {"hidden_size": 4096, "num_hidden_layers": 32, "vocab_size": 32000,
              "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
              "torch_dtype": "bfloat16"}  # fmt: skip
    cache_model(host.cache, "acme/dense-7b", config)
    host.settings.update(model_name="acme/dense-7b")
    out = consistent(host.run())
    assert "14.5 GB of weights" in out.text("memory")  # 7.24 B parameters (Mistral-7B) x 2 bytes
    assert "no MoE layers" in out.text("moe-backend")


def test_bad_fraction_is_named(host: FakeHost) -> None:
    host.settings.update(prefill_gpu_memory_utilization="85%")
    text = consistent(host.run()).text("memory")
    assert "PREFILL_GPU_MEMORY_UTILIZATION='85%' is not a fraction of GPU memory in (0, 1]" in text


# -- driver vs the image's CUDA -------------------------------------------------------------------
def test_old_driver_fails_for_a_cuda_13_image(host: FakeHost) -> None:
    host.gpus = gpu_rows(H100, H100, H100, driver="575.57.08")
    text = consistent(host.run()).text("driver-cuda")
    assert "driver 575.57.08 is too old for vllm/vllm-openai:v0.32.0, a CUDA 13.0 build" in text
    assert "needs driver >= 580.65.06: upgrade the NVIDIA driver" in text
    assert "a cu129 variant" in text


def test_plain_tag_means_cuda_13_without_the_image(host: FakeHost) -> None:
    host.image = None
    host.gpus = gpu_rows(H100, H100, H100, driver="570.172.08")
    text = consistent(host.run()).text("driver-cuda")
    assert "a CUDA 13.0 build (its tag)" in text


@pytest.mark.parametrize(
    ("tag", "driver", "status"),
    [
        ("v0.32.0-cu129", "575.57.08", "ok"),
        ("v0.32.0-cu128", "570.133.20", "ok"),
        ("v0.32.0-cu128", "565.57.01", "FAIL"),
        ("v0.32.0-cu129", "570.133.20", "FAIL"),
    ],
)
def test_cuda_tags(host: FakeHost, tag: str, driver: str, status: str) -> None:
    host.image = None
    host.settings.update(vllm_image=f"vllm/vllm-openai:{tag}")
    host.gpus = gpu_rows(H100, H100, H100, driver=driver)
    assert consistent(host.run()).status("driver-cuda") == [status]


def test_image_cuda_version_wins_over_the_tag(host: FakeHost) -> None:
    host.settings.update(vllm_image="registry.example/vllm:v0.32.0-cu129")
    host.image = {"Config": {"Env": ["PATH=/usr/bin", "CUDA_VERSION=12.8.1"]}}
    host.gpus = gpu_rows(H100, H100, H100, driver="570.133.20")
    out = consistent(host.run())
    assert out.status("driver-cuda") == ["ok"]
    assert "CUDA 12.8 from the image's CUDA_VERSION" in out.text("driver-cuda")


def test_unknown_cuda_is_a_warning(host: FakeHost) -> None:
    host.image = None
    host.settings.update(vllm_image="acme/vllm:latest")
    out = consistent(host.run())
    assert out.status("driver-cuda") == ["WARN"]
    assert "could not tell which CUDA acme/vllm:latest is built for" in out.text("driver-cuda")
