"""vLLM 0.32.0's rules for --moe-backend, read from its source: the valid names
(`MoEBackend` in vllm/config/kernel.py), the ones an unquantized (bf16) MoE layer accepts
(`map_unquantized_backend` in fused_moe/oracle/unquantized.py) and the GPUs each kernel runs on
(`_supports_current_device` of its experts class)."""

from __future__ import annotations

from collections.abc import Callable

#: vllm/config/kernel.py `MoEBackend`, in its order.
BACKENDS = (
    "auto", "triton", "batched_triton", "deep_gemm", "deep_gemm_mega_moe", "cutlass",
    "flashinfer_trtllm", "flashinfer_cutlass", "flashinfer_cutedsl", "flashinfer_moe_ep_cutedsl",
    "flashinfer_b12x", "b12x", "flashinfer_moe_ep_mega_deep_gemm", "marlin", "humming",
    "triton_unfused", "aiter", "aiter_mega_moe", "aiter_triton_mxfp4_bf16", "flydsl", "hpc",
    "emulation", "rdna3",
)  # fmt: skip
#: Accepted for unquantized MoE; `auto` and `humming` fall through to automatic selection.
UNQUANTIZED = ("triton", "batched_triton", "flashinfer_trtllm", "flashinfer_cutlass", "aiter")
FALLS_BACK_TO_AUTO = ("auto", "humming")


def normalize(value: str) -> str:
    """What vLLM's validator does to the value before checking it: lower case, '-' -> '_'."""
    return value.strip().lower().replace("-", "_")


#: The GPUs each bf16 kernel runs on, and how a FAIL line says it (any other backend: any CUDA GPU).
KERNEL_GPUS: dict[str, tuple[Callable[[tuple[int, int]], bool], str]] = {
    # SM 9.0 exactly, 10.x, 12.x (SM 11.x excluded)
    "flashinfer_cutlass": (lambda cap: cap == (9, 0) or cap[0] in (10, 12), "SM 9.0, 10.x or 12.x"),
    "flashinfer_trtllm": (lambda cap: cap[0] == 10, "SM 10.x (Blackwell)"),
    "aiter": (lambda cap: False, "an AMD GPU (ROCm)"),
}


def runs_on(backend: str, cap: tuple[int, int]) -> bool:
    """Whether the bf16 kernel of `backend` supports a GPU of compute capability `cap`."""
    return KERNEL_GPUS[backend][0](cap) if backend in KERNEL_GPUS else True


def requirement(backend: str) -> str:
    return KERNEL_GPUS[backend][1] if backend in KERNEL_GPUS else "a CUDA GPU"


def auto_choice(cap: tuple[int, int]) -> str:
    """The kernel `auto` tries first for bf16 MoE: FlashInfer TRTLLM, then FlashInfer CUTLASS,
    then Triton, with both FlashInfer kernels moved behind Triton on Hopper (SM 9.x)."""
    if cap[0] == 9:
        return "triton"
    for backend in ("flashinfer_trtllm", "flashinfer_cutlass"):
        if runs_on(backend, cap):
            return backend
    return "triton"
