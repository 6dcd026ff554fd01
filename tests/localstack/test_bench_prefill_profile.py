"""`pcp-pd-kit bench prefill-profile`'s pure parts: py-spy's raw stacks into groups, the table."""

from __future__ import annotations

from pcp_pd_kit.bench import prefill_profile as bench

RAW = [
    "<module> (x.py:1);worker_busy_loop (multiproc_executor.py:1);dequeue (shm_broadcast.py:9);"
    "SpinCondition.wait (vllm/distributed/device_communicators/shm_broadcast.py:208) 40",
    "execute_model (vllm/v1/worker/gpu/model_runner.py:9);Module._call_impl (torch/nn/m.py:1);"
    "forward_mha (mla_attention.py:3);_ragged_sdpa (cpu_sdpa.py:69) 30",
    "execute_model (model_runner.py:9);Module._call_impl (m.py:1);all_gatherv (ep.py:2);"
    "CpuCommunicator.all_gather (cpu_communicator.py:134) 20",
    "prepare_inputs (model_runner.py:1450);prepare_prefill_inputs (input_batch.py:331);"
    "GridExecutor.__call__ (triton/runtime/interpreter.py:1515) 25",
    "execute_model (model_runner.py:9);Module._call_impl (m.py:1);rms_norm (layernorm.py:17) 10",
    "sample_tokens (model_runner.py:1700);postprocess (x.py:1) 5",
    "Thread.run (threading.py:1) 3",
    "dequeue (shm_broadcast.py:9);sleeping_wait.<locals>.wait "
    "(pcp_nixl_connector/cpu_compat/idle_wait.py:60) 7",
    "not a sample line",
]


def test_stacks_go_to_the_innermost_group_that_names_what_they_do() -> None:
    counts = bench.shares(RAW)
    groups = dict(bench.GROUPS)
    names = list(groups)
    assert counts[names[0]] == 47  # a wait for the next step (vLLM's or the kit's), wherever
    # it is called from
    assert counts["MLA prefill attention"] == 30  # not "the model's other layers"
    assert counts[names[3]] == 20  # the collective, inside the MoE layer
    assert counts["Triton interpreter"] == 25
    assert counts[names[4]] == 10
    assert counts["the model runner, other"] == 5
    assert counts[bench.OTHER] == 3
    assert sum(counts.values()) == 140


def test_the_table_gives_each_variant_its_shares_side_by_side() -> None:
    before = bench.shares(RAW)
    after = bench.shares(RAW[:1])
    table = bench.format_table({"before": before, "after": after}).splitlines()
    assert table[0] == "| group | before (140 samples) | after (40 samples) |"
    assert table[2].endswith("| 34% | 100% |")
    assert any(line.startswith("| MLA prefill attention | 21% | 0% |") for line in table)
