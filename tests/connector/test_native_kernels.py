"""Model Runner V2's kernels in torch against the originals under Triton's interpreter.

The kernels must be defined with Triton in interpreter mode, as in the prefill's workers (which
inherit ``TRITON_INTERPRET=1`` from the engine process the kit's platform hook set it in), so
the comparison runs in a process of its own (``native_kernels_probe``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

from pcp_nixl_connector.cpu_compat import TRITON_INTERPRETER_ENV, native_kernels, upstream_gate
from tests.support.paths import CONNECTOR_DIR, REPO

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def probe() -> dict[str, Any]:
    env = {**os.environ, TRITON_INTERPRETER_ENV: "1", "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(CONNECTOR_DIR), str(REPO)])}  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "tests.connector.native_kernels_probe"],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def test_every_torch_version_writes_what_the_interpreted_kernel_writes(probe: dict) -> None:
    results = probe["results"]
    kinds = {name.split(" ")[0] for name in results}
    assert kinds == {"apply_write", "compute_slot_mappings", "gather_block_tables",
                     "gumbel_sample", "prepare_pos_seq_lens", "prepare_prefill_inputs",
                     "combine_sampled_and_draft_tokens", "get_num_sampled_and_rejected",
                     "post_update"}  # fmt: skip
    assert [name for name, equal in results.items() if not equal] == []
    # Sampling rows (temperature > 0) went to the original kernel and drew the same tokens.
    assert any("0.7" in name for name in results)


def test_the_kernels_left_interpreted_are_named_and_the_replaced_ones_are_not(
    probe: dict,
) -> None:
    left = probe["interpreted"]
    # Kernels the step does not launch on the CPU stack stay interpreted, and are named.
    assert "input_batch._post_update_num_computed_tokens_kernel" in left
    replaced = {name for _module, name in native_kernels.REPLACED}
    assert not replaced & {entry.rsplit(".", 1)[-1] for entry in left}
    assert all(entry.endswith("_kernel") for entry in left)


def test_an_unchecked_vllm_is_refused() -> None:
    with pytest.raises(upstream_gate.UpstreamGateError, match="Triton's interpreter"):
        native_kernels.install(vllm_version="0.34.0")
