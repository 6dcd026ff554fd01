"""Run in a process of its own with the Triton-interpreter knob on (the kernels must be defined
after the kit's platform hook switched Triton to its interpreter): each torch version of
``native_kernels`` and the original kernel, under the interpreter, on the same random inputs.
Prints one JSON object: case -> whether every buffer the two wrote is equal."""

from __future__ import annotations

import copy
import json
import random
import sys
from collections.abc import Callable
from typing import Any

import torch


def staged_writes(shape: Any, dtype: torch.dtype, seed: int) -> tuple[Any, Any]:
    """Two identical StagedWriteTensors with the same random rows and staged writes."""
    from vllm.v1.worker.gpu.buffer_utils import StagedWriteTensor

    rng = random.Random(seed)
    tensor = StagedWriteTensor(shape, dtype=dtype, device=torch.device("cpu"))
    tensor.gpu.copy_((torch.rand(tensor.gpu.shape) * 1000).to(dtype))
    rows, width = tensor.num_rows, (shape[1] if isinstance(shape, tuple) else 1)
    for _ in range(rng.randint(1, 6)):
        index = rng.randrange(rows)
        if width == 1:
            tensor.stage_write_elem(index, rng.randint(-5, 5000))
        else:
            start = rng.randrange(width)
            values = [rng.randint(-5, 5000) for _ in range(rng.randint(1, width - start))]
            tensor.stage_write(index, start, values)
    return tensor, copy.deepcopy(tensor)


def apply_write_cases(original: Callable[[Any], None]) -> dict[str, bool]:
    out = {}
    for seed, (shape, dtype) in enumerate(
        [((8, 50), torch.int32), ((8, 3000), torch.int32), (64, torch.int64),
         ((4, 7), torch.float32)] * 3
    ):  # fmt: skip
        kernel, native = staged_writes(shape, dtype, seed)
        original(kernel)
        native.apply_write()
        equal = torch.equal(kernel.gpu, native.gpu) and not native._staged_write_indices
        out[f"apply_write {shape} {dtype} #{seed}"] = equal
    return out


def block_tables(cp_size: int, cp_rank: int, interleave: int, seed: int) -> Any:
    from vllm.v1.worker.gpu.block_table import BlockTables

    torch.manual_seed(seed)
    tables = BlockTables(
        block_sizes=[16, 32], max_num_reqs=8, max_num_batched_tokens=600,
        max_num_blocks_per_group=[40, 24], device=torch.device("cpu"), cp_size=cp_size,
        cp_rank=cp_rank, cp_interleave=interleave, slot_mapping_enabled=[True, seed % 3 != 0],
        dcp_sharded=[True, seed % 2 == 0],
    )  # fmt: skip
    for table in tables.block_tables:
        table.gpu.copy_(torch.randint(0, 500, table.gpu.shape, dtype=torch.int32))
    tables.num_blocks.gpu.copy_(
        torch.randint(0, 25, tables.num_blocks.gpu.shape, dtype=torch.int32)
    )
    tables.slot_mappings.copy_(torch.randint(0, 9, tables.slot_mappings.shape))
    for dest in tables.input_block_tables:
        dest.copy_(torch.randint(0, 9, dest.shape, dtype=torch.int32))
    return tables


def batch(seed: int, max_position: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """idx_mapping (a -1 dummy request now and then), query_start_loc, positions."""
    rng = random.Random(seed)
    num_reqs = rng.randint(1, 6)
    reqs = rng.sample(range(8), num_reqs)
    if seed % 4 == 1:
        reqs[-1] = -1
    counts = [rng.randint(1, 90) for _ in reqs]
    starts = [0]
    for count in counts:
        starts.append(starts[-1] + count)
    positions = [rng.randrange(max_position) for _ in range(starts[-1])] + [0] * 7
    return (
        torch.tensor(reqs, dtype=torch.int32),
        torch.tensor(starts, dtype=torch.int32),
        torch.tensor(positions, dtype=torch.int64),
    )


def slot_mapping_cases(original: Callable[..., torch.Tensor]) -> dict[str, bool]:
    out = {}
    for seed in range(12):  # DCP 1: vLLM's kernel with cp_size > 1 fails in the interpreter
        kernel = block_tables(1, 0, 1, seed)
        native = copy.deepcopy(kernel)
        kernel.init_block_table_layout_tensors()  # pointers to this copy's own tensors
        idx, starts, positions = batch(seed, 16 * 20)
        padded = int(starts[-1]) + 5
        want = original(kernel, idx, starts, positions, padded)
        got = native.compute_slot_mappings(idx, starts, positions, padded)
        equal = torch.equal(want, got) and torch.equal(kernel.slot_mappings, native.slot_mappings)
        out[f"compute_slot_mappings #{seed}"] = equal
    return out


def gather_cases(original: Callable[..., Any]) -> dict[str, bool]:
    out = {}
    for seed in range(6):
        kernel = block_tables(1, 0, 1, seed)
        native = copy.deepcopy(kernel)
        kernel.init_block_table_layout_tensors()
        rng = random.Random(seed)
        idx = torch.tensor(rng.sample(range(8), rng.randint(0, 5)), dtype=torch.int32)
        padded = idx.shape[0] + rng.randint(0, 3)
        want = original(kernel, idx, padded)
        got = native.gather_block_tables(idx, padded)
        equal = all(torch.equal(a, b) for a, b in zip(want, got, strict=True)) and all(
            torch.equal(a, b)
            for a, b in zip(kernel.input_block_tables, native.input_block_tables, strict=True)
        )
        out[f"gather_block_tables {idx.shape[0]} rows padded to {padded} #{seed}"] = equal
    return out


def gumbel_cases(original_kernel: Any) -> dict[str, bool]:
    from vllm.v1.worker.gpu.sample import gumbel

    native_kernel = gumbel._gumbel_sample_kernel
    out = {}
    for seed, (tokens, vocab, temps, fp64) in enumerate([
        (3, 3000, [0.0, 0.0, 0.0], False), (5, 1024, [0.0] * 5, True),
        (2, 2500, [0.0, 0.7], False), (4, 700, [1.0, 0.0, 0.3, 0.0], True),
    ]):  # fmt: skip
        torch.manual_seed(seed)
        logits = torch.randn(tokens, vocab) * 4
        mapping = torch.arange(tokens, dtype=torch.int32)
        temperature = torch.tensor(temps + [0.0] * 3, dtype=torch.float32)
        seeds = torch.randint(0, 2**31, (tokens + 3,), dtype=torch.int64)
        pos = torch.randint(0, 900, (tokens,), dtype=torch.int64)
        sampled = []
        for kernel in (original_kernel, native_kernel):
            gumbel._gumbel_sample_kernel = kernel
            sampled.append(
                gumbel.gumbel_sample(logits, mapping, temperature, seeds, pos,
                                     apply_temperature=True, is_drafting=False, use_fp64=fp64)
            )  # fmt: skip
        gumbel._gumbel_sample_kernel = native_kernel
        greedy = torch.tensor(temps) == 0
        exact = torch.equal(sampled[0], sampled[1])
        argmax = torch.equal(sampled[1][greedy], logits[greedy].argmax(-1))
        out[f"gumbel_sample temps {temps} fp64={fp64}"] = exact and argmax
    return out


def main() -> int:
    from vllm.platforms import current_platform

    assert current_platform.is_cpu()
    import vllm.v1.worker.cpu.shm  # noqa: F401  (what vLLM's CPU worker runs first: CPU buffers)
    from triton.runtime.interpreter import InterpretedFunction
    from vllm.v1.worker.gpu import block_table, buffer_utils, input_batch
    from vllm.v1.worker.gpu.sample import gumbel

    from pcp_nixl_connector.cpu_compat import input_batch_kernels, native_kernels
    from tests.connector import input_batch_cases

    assert isinstance(block_table._compute_slot_mappings_kernel, InterpretedFunction)
    originals = (
        buffer_utils.StagedWriteTensor.apply_write,
        block_table.BlockTables.compute_slot_mappings,
        block_table.BlockTables.gather_block_tables,
        gumbel._gumbel_sample_kernel,
    )
    input_originals = {name: getattr(input_batch, name) for name in input_batch_kernels.BODIES}
    assert native_kernels.install(vllm_version="0.32.0") is True
    assert native_kernels.install(vllm_version="0.32.0") is False and native_kernels.installed()
    results = {
        **apply_write_cases(originals[0]),
        **slot_mapping_cases(originals[1]),
        **gather_cases(originals[2]),
        **gumbel_cases(originals[3]),
        **input_batch_cases.cases(input_originals),
    }
    interpreted = native_kernels.interpreted_kernels()
    print(json.dumps({"results": results, "interpreted": interpreted}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
