"""What one `bench serve` run is, as plain data: the plan, the targets, the run order and each
`vllm bench serve` argv (the tests parse them with vLLM's own parser). No I/O."""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pcp_pd_kit.bench.client import BenchError
from pcp_pd_kit.settings import StackSettings, kit_env, settings_from_env

VLLM_SERVE_MODULE = "pcp_pd_kit.bench.vllm_serve"
# Prompts per level: at least MIN_PROMPTS (a median of fewer moves with every hiccup of a busy
# machine), PROMPTS_PER_SLOT per slot (a high level runs mostly at full concurrency, not ramping).
MIN_PROMPTS, PROMPTS_PER_SLOT = 64, 8
# The bench's own ports (base + offset), apart from `make up` (18000-18300) and the e2e suite
# (18500-18590), so it runs beside either.
DEFAULT_PORT_BASE = 18400
PORT_OFFSETS = {
    "proxy_port": 0, "prefill_port": 10, "prefill_side_channel_port": 11,
    "prefill_kv_events_port": 12, "prefill_kv_replay_port": 13, "decode_port": 20,
    "decode_side_channel_port": 21, "decode_kv_events_port": 22, "decode_kv_replay_port": 23,
    "reference_port": 30,
    "prometheus_port": 90,  # never started by the bench; moved so it cannot clash either
}  # fmt: skip
# The pd-proxies with --first-token-from-prefill and with --local-prefill-max-tokens N, in front
# of the same prefill + decode (the local stack takes their ports as arguments).
FIRST_TOKEN_PROXY_OFFSET, LOCAL_PREFILL_PROXY_OFFSET = 1, 2
# docs/bench.md: single (one vLLM), pd (P/D through pd-proxy), pd-local and pd-ft (proxy options)
TARGETS = ("single", "pd", "pd-local", "pd-ft")
TARGET_TITLES = {"single": "single", "pd": "P/D", "pd-local": "P/D+local", "pd-ft": "P/D 1st-tok"}
SHORT_LEVEL = 1
# Workload tags in result names; long: the main prompt length at c=1 on pd and pd-local.
MAIN, SHORT, LONG = "", "short", "long"
# The dataset seed of each (workload, level) is --seed + this + the level: every run of a target
# gets prompts no earlier run of it sent (with prefix caching on, a repeated prompt is a cache
# hit, not speed), and single and P/D get the same prompts at the same level.
WORKLOAD_SEED_OFFSETS = {MAIN: 0, SHORT: 100_000, LONG: 200_000}


class BenchSpecError(BenchError):
    """A bench option the run cannot use; the message names it."""


def default_prompts(level: int) -> int:
    return max(MIN_PROMPTS, PROMPTS_PER_SLOT * level)


def parse_ints(text: str, flag: str, expected: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise BenchSpecError(f"{flag} {text!r}: expected {expected}") from None


def parse_levels(text: str) -> tuple[int, ...]:
    """'1,4,16' -> (1, 4, 16); each a positive integer, no duplicates."""
    levels = parse_ints(text, "--concurrency", "integers like 1,4,16")
    if not levels:
        raise BenchSpecError("--concurrency is empty")
    if any(level < 1 for level in levels):
        raise BenchSpecError(f"--concurrency {text!r}: every level must be >= 1")
    if len(set(levels)) != len(levels):
        raise BenchSpecError(f"--concurrency {text!r}: a level is repeated")
    return levels


def parse_prompts(text: str | None, levels: Sequence[int]) -> tuple[int, ...]:
    """Prompts per level: None -> default_prompts; 'N' -> N for each; 'a,b,c' -> one per level."""
    if text is None or not text.strip():
        return tuple(default_prompts(level) for level in levels)
    counts = parse_ints(text, "--prompts", "N or one count per level")
    counts = counts * len(levels) if len(counts) == 1 else counts
    if len(counts) != len(levels):
        raise BenchSpecError(
            f"--prompts {text!r}: {len(counts)} counts for {len(levels)} concurrency levels"
        )
    if any(count < 1 for count in counts):
        raise BenchSpecError(f"--prompts {text!r}: every count must be >= 1")
    return counts


def bench_ports(base: int, offsets: Mapping[str, int] = PORT_OFFSETS) -> dict[str, int]:
    """StackSettings port fields (or `bench cache`'s own) for the bench's stack, from one base."""
    if not 1 <= base <= 65535 - max(PORT_OFFSETS.values()):
        raise BenchSpecError(f"--port-base {base}: the bench needs base..base+90 inside 1-65535")
    return {name: base + offset for name, offset in offsets.items()}


def bench_settings(port_base: int, **changes: Any) -> StackSettings:
    """The kit's settings (environment) on the bench's ports, with ``changes``."""
    base = settings_from_env(kit_env(os.environ))
    return dataclasses.replace(base, **bench_ports(port_base), **changes)  # type: ignore[arg-type]


@dataclass(frozen=True)
class BenchPlan:
    """Everything that makes two runs comparable: dataset, lengths, seed, levels, prompts."""

    levels: tuple[int, ...] = (1, 4, 16)
    prompts: tuple[int, ...] = tuple(default_prompts(level) for level in (1, 4, 16))
    # Not a whole number of KV blocks (16 on CPU, 16 to 128 on GPU): at N = k x block_size tokens
    # the prefill's blocks have no slot for position N, so the first-token proxy would take the
    # normal flow for every request (`kv_blocks`) and its mode go unmeasured.
    input_len: int = 250
    output_len: int = 64
    seed: int = 0
    temperature: float = 0.0
    backend: str = "vllm"
    endpoint: str = "/v1/completions"
    breakdown_level: int = 4
    run_timeout_s: float = 900.0

    def __post_init__(self) -> None:
        if self.input_len < 1 or self.output_len < 1:
            raise BenchSpecError("--input-len and --output-len must be >= 1")
        if self.run_timeout_s <= 0:
            raise BenchSpecError("--run-timeout must be > 0")

    def prompts_for(self, level: int) -> int:
        return self.prompts[self.levels.index(level)]

    def seed_for(self, level: int, workload: str = MAIN) -> int:
        """The dataset seed of one run: its own prompts, the same on every target."""
        return self.seed + WORKLOAD_SEED_OFFSETS[workload] + level

    def focus_level(self) -> int:
        """The level the breakdown is printed for: breakdown_level, else the nearest one run."""
        return min(self.levels, key=lambda level: (abs(level - self.breakdown_level), level))

    def as_dict(self) -> dict[str, object]:
        prompts = dict(zip(map(str, self.levels), self.prompts, strict=True))
        fixed = {"dataset": "random", "random_range_ratio": 0.0}  # as bench_serve_argv passes
        return {**dataclasses.asdict(self), "prompts": prompts, **fixed}


@dataclass(frozen=True)
class ShortPlan:
    """The short prompts of pd-local's check at concurrency 1: N sits above them (plus the BOS) and
    below the long ones (BenchPlan.input_len), so one proxy takes the local path only for them."""

    input_len: int = 32
    output_len: int = 32  # TTFT does not depend on it; shorter keeps the run short
    prompts: int = 32
    max_tokens: int = 64  # the pd-local proxy's N

    def __post_init__(self) -> None:
        if self.input_len < 1 or self.output_len < 1 or self.prompts < 1:
            raise BenchSpecError("--short-input-len, --short-output-len, --short-prompts: >= 1")
        if self.max_tokens < 1:
            raise BenchSpecError("--local-prefill-max-tokens must be >= 1")

    def short(self, base: BenchPlan) -> BenchPlan:
        """The short prompts at concurrency 1, otherwise as the main plan."""
        return dataclasses.replace(self.long(base), input_len=self.input_len)

    def long(self, base: BenchPlan) -> BenchPlan:
        """The main prompt length with the short workload's count, output and concurrency."""
        return dataclasses.replace(
            base, levels=(SHORT_LEVEL,), prompts=(self.prompts,), output_len=self.output_len
        )

    def problems(self, base: BenchPlan) -> list[str]:
        """Why a path check will say NOT MEASURED, known before anything runs."""
        out, n = [], f"--local-prefill-max-tokens {self.max_tokens}"
        if self.input_len >= self.max_tokens:
            out.append(f"--short-input-len {self.input_len} is not below {n}: the short prompts "
                       "will not take the local path")  # fmt: skip
        if base.input_len <= self.max_tokens:
            out.append(f"--input-len {base.input_len} is not above {n}: the long check's prompts "
                       "will not take P/D")  # fmt: skip
        return out

    def as_dict(self) -> dict[str, object]:
        return {**dataclasses.asdict(self), "concurrency": SHORT_LEVEL}


def run_order(
    targets: Sequence[str], base: BenchPlan, short: ShortPlan, wanted: Sequence[str]
) -> list[tuple[str, str, BenchPlan]]:
    """(target, workload tag, plan) in run order: main on single and pd; with pd-local wanted, short
    then long prompts, each pair back to back (a busy moment falls on both sides); pd-ft last."""
    runs = [(t, MAIN, base) for t in targets if t in ("single", "pd")]
    if "pd-local" in wanted:
        runs += [
            (t, SHORT, short.short(base)) for t in ("single", "pd", "pd-local") if t in targets
        ]
        if "pd-local" in targets:
            runs += [(t, LONG, short.long(base)) for t in ("pd", "pd-local") if t in targets]
    runs += [(t, MAIN, base) for t in targets if t == "pd-ft"]
    return runs


@dataclass(frozen=True)
class Target:
    """One endpoint to benchmark, named by one of TARGETS."""

    name: str
    base_url: str
    served_model_name: str
    tokenizer: str


def run_name(target: str, level: int, workload: str = MAIN) -> str:
    """'pd-c4' for the main workload, 'pd-local-short-c1' for another."""
    return f"{target}-{workload}-c{level}" if workload else f"{target}-c{level}"


def vllm_bench_argv(
    python: str, base_url: str, served: str, tokenizer: str, options: Mapping[str, object],
    flags: Sequence[str], result_dir: str, result_filename: str,
) -> list[str]:  # fmt: skip
    """`vllm bench serve` (VLLM_SERVE_MODULE) on /v1/completions, saving its JSON result."""
    pairs = {"--backend": "vllm", "--base-url": base_url.rstrip("/"),
             "--endpoint": "/v1/completions", "--model": tokenizer,
             "--served-model-name": served, "--tokenizer": tokenizer, **options}  # fmt: skip
    options_argv = [str(part) for pair in pairs.items() for part in pair]
    tail = ["--save-result", "--result-dir", result_dir, "--result-filename", result_filename]
    return [python, "-m", VLLM_SERVE_MODULE, *options_argv, *flags, *tail]


def bench_serve_argv(
    target: Target, plan: BenchPlan, level: int, result_dir: str,
    python: str = sys.executable, workload: str = MAIN,
) -> list[str]:  # fmt: skip
    """One target at one level: fixed lengths and greedy, so single and P/D do the same work."""
    options = {
        "--dataset-name": "random", "--random-input-len": plan.input_len,
        "--random-output-len": plan.output_len, "--random-range-ratio": 0,
        "--seed": plan.seed_for(level, workload),
        "--num-prompts": plan.prompts_for(level), "--max-concurrency": level,
        "--temperature": plan.temperature, "--percentile-metrics": "ttft,tpot,itl,e2el",
        "--metric-percentiles": "50,99", "--label": target.name,
    }  # fmt: skip
    flags = ["--ignore-eos", "--disable-tqdm",
             "--save-detailed",  # per-request ITLs: serve_report.delivery reads the arrivals
             "--metadata", f"target={target.name}", f"concurrency={level}",
             f"workload={workload or 'main'}"]  # fmt: skip
    return vllm_bench_argv(python, target.base_url, target.served_model_name, target.tokenizer,
                           options, flags, result_dir,
                           f"{run_name(target.name, level, workload)}.json")  # fmt: skip
