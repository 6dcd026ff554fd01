"""The CPU plugins' pure parts: knobs, core groups and variable-size collectives."""

from __future__ import annotations

import pytest
import torch

from pcp_nixl_connector.cpu_compat import FIXES_ENV, SLEEPING_WAIT_ENV, TRITON_INTERPRETER_ENV
from pcp_nixl_connector.cpu_compat.binding import omp_threads_bind, parse_cpu_list
from pcp_nixl_connector.cpu_compat.expert_parallel import gather_varlen, scatter_varlen_sum
from pcp_nixl_connector.cpu_compat.knobs import (
    KnobError,
    knob_on,
    wants_fixes,
    wants_triton_interpreter,
)
from pcp_nixl_connector.cpu_compat.triton_interpreter import INTERPRET_ENV, enable


@pytest.mark.parametrize(
    ("value", "want"),
    [(None, False), ("", False), ("0", False), ("off", False), ("1", True), (" TRUE ", True)],
)
def test_knob_values(value: str | None, want: bool) -> None:
    env = {} if value is None else {FIXES_ENV: value}
    assert knob_on(env, FIXES_ENV) is want


def test_a_knob_that_is_neither_on_nor_off_is_named() -> None:
    with pytest.raises(KnobError, match=f"{FIXES_ENV}='maybe'"):
        knob_on({FIXES_ENV: "maybe"}, FIXES_ENV)


def test_knobs_do_nothing_off_the_cpu_build() -> None:
    env = {FIXES_ENV: "1", TRITON_INTERPRETER_ENV: "1"}
    assert wants_fixes(env, cpu_build=True) and wants_triton_interpreter(env, cpu_build=True)
    assert not wants_fixes(env, cpu_build=False)
    assert not wants_triton_interpreter(env, cpu_build=False)


@pytest.mark.parametrize(
    ("text", "cores"),
    [("0", [0]), ("0,1", [0, 1]), ("2-5", [2, 3, 4, 5]), ("0-1, 4", [0, 1, 4]), ("1,0,1", [0, 1])],
)
def test_cpu_lists(text: str, cores: list[int]) -> None:
    assert parse_cpu_list(text) == cores


@pytest.mark.parametrize("text", ["", "a", "1-", "3-1", "0;1", "-1"])
def test_bad_cpu_lists(text: str) -> None:
    with pytest.raises(ValueError, match=repr(text)):
        parse_cpu_list(text)


@pytest.mark.parametrize(
    ("cores", "ranks", "bind"),
    [
        ([0], 1, "0"),
        ([0, 1], 2, "0|1"),
        ([0, 1, 2, 3], 2, "0,1|2,3"),
        ([4, 5], 1, "4,5"),
        ([0], 2, "0|0"),  # fewer cores than ranks: they take turns (2-core machines)
        ([2, 3], 4, "2|3|2|3"),
    ],
)
def test_cores_split_evenly_per_rank(cores: list[int], ranks: int, bind: str) -> None:
    assert omp_threads_bind(cores, ranks) == bind


@pytest.mark.parametrize(("cores", "ranks"), [([0, 1, 2], 2), ([0, 1], 3), ([0, 1], 0), ([], 1)])
def test_uneven_core_splits_are_refused(cores: list[int], ranks: int) -> None:
    with pytest.raises(ValueError):
        omp_threads_bind(cores, ranks)


def test_varlen_gather_and_reduce_scatter_match_a_two_rank_reference() -> None:
    sizes = [3, 1]
    per_rank = [torch.arange(6.0).view(3, 2), torch.tensor([[10.0, 11.0]])]

    def all_gather_equal(padded: torch.Tensor) -> list[torch.Tensor]:
        # what every rank would receive: each rank's input padded to max(sizes) rows
        out = []
        for tensor in per_rank:
            pad = tensor.new_zeros((max(sizes), 2))
            pad[: tensor.shape[0]] = tensor
            out.append(pad)
        return out

    gathered = gather_varlen(per_rank[1], sizes, 0, all_gather_equal)
    assert torch.equal(gathered, torch.cat(per_rank))

    contributions = [torch.ones(4, 2), 2 * torch.ones(4, 2)]

    def all_reduce_sum(tensor: torch.Tensor) -> None:
        tensor.copy_(sum(contributions))

    mine = scatter_varlen_sum(contributions[1].clone(), sizes, 0, 1, all_reduce_sum)
    assert torch.equal(mine, 3 * torch.ones(1, 2))
    rank0 = scatter_varlen_sum(contributions[0].clone(), sizes, 0, 0, all_reduce_sum)
    assert rank0.shape == (3, 2)


def test_triton_enable_registers_once_and_leaves_a_real_backend_alone() -> None:
    env: dict[str, str] = {}
    backends: dict[str, object] = {"nvidia": object()}
    assert enable(env, backends) is True
    assert env[INTERPRET_ENV] == "1" and "cpu" in backends
    driver = backends["cpu"].driver  # type: ignore[attr-defined]
    assert driver.is_active()
    with pytest.raises(RuntimeError, match="only the interpreter"):
        driver().get_current_target()
    assert enable(env, backends) is False
    real = {"cpu": "triton-cpu"}
    assert enable({}, real) is False and real == {"cpu": "triton-cpu"}


def test_launch_of_a_pcp2_ep2_prefill_and_a_pcp1_server() -> None:
    from pcp_nixl_connector.cpu_compat.launch import cpu_server_launch

    flags, env = cpu_server_launch(2, True, [0, 1])
    assert flags == ["--prefill-context-parallel-size", "2", "--enable-expert-parallel"]
    assert env == {
        FIXES_ENV: "1",
        TRITON_INTERPRETER_ENV: "1",
        SLEEPING_WAIT_ENV: "1",
        "VLLM_CPU_OMP_THREADS_BIND": "0|1",
    }
    assert cpu_server_launch(2, False, [0, 1])[0] == ["--prefill-context-parallel-size", "2"]
    flags, env = cpu_server_launch(1, True, [3], sleeping_wait=False)
    assert flags == [] and env == {FIXES_ENV: "1", "VLLM_CPU_OMP_THREADS_BIND": "3"}
    assert cpu_server_launch(2, True, [0])[1]["VLLM_CPU_OMP_THREADS_BIND"] == "0|0"
    with pytest.raises(ValueError, match="cannot be split evenly over 2"):
        cpu_server_launch(2, True, [0, 1, 2])


def test_prefix_caching_flag_and_its_detection() -> None:
    from pcp_nixl_connector.cpu_compat.launch import gives_prefix_caching_flag, prefix_caching_flag

    assert prefix_caching_flag(True) == "--enable-prefix-caching"
    assert prefix_caching_flag(False) == "--no-enable-prefix-caching"
    for argv in (["--enable-prefix-caching"], ["--no_enable_prefix_caching"], ["--seed", "0",
                 "--enable-prefix-caching=true"]):  # fmt: skip
        assert gives_prefix_caching_flag(argv)
    assert not gives_prefix_caching_flag(["--prefix-caching-hash-algo", "sha256", "--seed", "0"])
