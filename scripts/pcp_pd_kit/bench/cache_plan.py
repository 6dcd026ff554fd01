"""What `bench cache` starts and sends, as plain data: knobs, ports, prompts, the ideal cache-hit
count, and the flags it appends to the kit's server and proxy command lines (a flag the builders
pass is replaced, as KV events, or overridden: argparse keeps the last one). No I/O."""

from __future__ import annotations

import dataclasses
import json
import random
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pcp_pd_kit.bench.prefix_ttft import token_ids
from pcp_pd_kit.bench.serve_plan import vllm_bench_argv
from pcp_pd_kit.bench.tokenize_cost import WORDS
from pcp_pd_kit.localstack.commands import ProcessSpec

KV_EVENTS_FLAG = "--kv-events-config"
# Offsets from --port-base, beside the serve bench's (spec.PORT_OFFSETS: 0-30, 90).
PORT_OFFSETS = {
    "proxy-count": 2,  # --local-prefill-max-tokens N, counting with decode's /tokenize
    "proxy-tokenizer": 3,  # the same with --tokenizer (the local tokenizer)
    "proxy-cache": 4,  # --prefix-cache-routing events + N + --tokenizer: the kit's cache setup
    "proxy-events": 5,  # two decodes, cache-aware
    "proxy-off": 6,  # two decodes, least outstanding requests
    "decode-a": 40, "decode-a-side": 41, "decode-b": 42, "decode-b-side": 43,
    "events-prefill": 50,  # ZMQ PUB; its replay ROUTER is the next port
    "events-decode": 52, "events-decode-a": 54, "events-decode-b": 56,
}  # fmt: skip
CACHE_ROUTING = "events"
SHORT_TARGETS = ("single", "tokenize", "tokenizer")
SHARED_MODES = ("events", "off")
HELD_ARMS = ("kit", "pinned")  # the cache-aware proxy; a client sending each prefix to its holder


@dataclass(frozen=True)
class CachePlan:
    """The three workloads' knobs (bench cache --help explains each)."""

    levels: tuple[int, ...] = (1, 4)
    conversations: int = 12  # per target and level
    context: int = 1440  # a first turn's tokens
    new: int = 40  # tokens a follow-up adds
    think_ms: float = 200.0  # between a conversation's two turns (events reach the proxy)
    local_max: int = 64  # --local-prefill-max-tokens of every proxy that counts
    short_requests: int = 32  # per target
    short_words: int = 28  # about 32 tokens with the tiny model's tokenizer
    prefix_len: int = 512
    suffix_len: int = 64
    prefixes: int = 8
    per_prefix: int = 6
    shared_output: int = 8
    shared_concurrency: int = 4
    shared_rounds: int = 2  # per mode, alternating
    kv_blocks: int = 192  # each of the two decodes' KV cache, in blocks
    shared_max_model_len: int = 1024
    seed: int = 9000
    run_timeout_s: float = 600.0

    def problems(self, block_size: int) -> list[str]:
        counts = {"--conversations": self.conversations, "--short-requests": self.short_requests,
                  "--prefixes": self.prefixes, "--per-prefix": self.per_prefix,
                  "--shared-rounds": self.shared_rounds,
                  "--local-max-tokens": self.local_max}  # fmt: skip
        out = [f"{flag} must be >= 1, got {n}" for flag, n in counts.items() if n < 1]
        if not self.levels or min(self.levels) < 1:
            out.append(f"--concurrency levels must be >= 1, got {list(self.levels)}")
        if self.new >= self.local_max:
            out.append(
                f"--new {self.new} must be below --local-max-tokens {self.local_max}: "
                "a follow-up's new tokens alone would send it P/D"
            )
        if self.context <= self.local_max:
            out.append(
                f"--context {self.context} must exceed --local-max-tokens {self.local_max}: "
                "a first turn must go P/D"
            )
        held = (self.kv_blocks - 1) * block_size  # vLLM keeps one block back (its null block)
        every = self.prefixes * prefix_blocks(self.prefix_len, block_size, 1)
        if self.kv_blocks >= every:
            out.append(
                f"--kv-blocks {self.kv_blocks} holds every prefix ({self.prefixes} x "
                f"{self.prefix_len} tokens = {every} blocks): one replica must not"
            )
        if held < self.shared_max_model_len:
            out.append(
                f"--kv-blocks {self.kv_blocks} less vLLM's null block, x block {block_size} = "
                f"{held} tokens, is below "
                f"the decodes' --max-model-len {self.shared_max_model_len}: vLLM refuses it"
            )
        longest = self.prefix_len + self.suffix_len + self.shared_output + 1
        if longest > self.shared_max_model_len:
            out.append(f"prefix + suffix + output ({longest}) exceed {self.shared_max_model_len}")
        return out

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def prefix_blocks(prefix_len: int, block_size: int, added: int) -> int:
    """Whole blocks of a shared prefix (after ``added`` special tokens): what a hit can reuse."""
    return (prefix_len + added) // block_size


def ideal_hit_tokens(plan: CachePlan, block_size: int, added: int) -> int:
    """Every request but the first of each prefix finds the prefix's whole blocks cached."""
    per_hit = prefix_blocks(plan.prefix_len, block_size, added) * block_size
    return plan.prefixes * (plan.per_prefix - 1) * per_hit


def kv_events_config(port: int) -> str:
    """vLLM's --kv-events-config: a ZMQ publisher on every interface, replay on the next port."""
    return json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                       "endpoint": f"tcp://*:{port}", "replay_endpoint": f"tcp://*:{port + 1}",
                       "topic": "kv"})  # fmt: skip


def with_kv_events(spec: ProcessSpec, port: int) -> ProcessSpec:
    """The server publishing KV events on ``port`` (its own --kv-events-config replaced)."""
    argv = [arg for arg in spec.argv if not arg.startswith(KV_EVENTS_FLAG + "=")]
    while KV_EVENTS_FLAG in argv:
        at = argv.index(KV_EVENTS_FLAG)
        del argv[at : at + 2]
    return dataclasses.replace(spec, argv=[*argv, KV_EVENTS_FLAG, kv_events_config(port)])


def with_flags(
    spec: ProcessSpec, flags: Sequence[str], name: str, env: dict[str, str] | None = None
) -> ProcessSpec:
    """The spec under another name with flags appended (and env additions)."""
    return dataclasses.replace(
        spec, name=name, argv=[*spec.argv, *flags], env={**spec.env, **(env or {})}
    )


def proxy_flags(
    routing: str, tokenizer: str | None, extra_decodes: Sequence[str] = ()
) -> list[str]:
    """pd-proxy flags for a cache mode, the local tokenizer and more decodes."""
    flags = ["--prefix-cache-routing", routing]
    if tokenizer:
        flags += ["--tokenizer", tokenizer]
    for url in extra_decodes:
        flags += ["--decode", url]
    return flags


def conversation(seed: int, context: int, new: int) -> tuple[list[int], list[int]]:
    first = token_ids(seed, context)
    return first, first + token_ids(seed + 1, new)


def short_prompt(seed: int, words: int) -> str:
    """``words`` words, different per seed from the first word on (nothing of it cached)."""
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def rotation(names: Sequence[str], index: int) -> list[str]:
    """``names`` rotated by ``index``: each target goes first as often as the others."""
    k = index % len(names)
    return [*names[k:], *names[:k]]


def prefix_bench_argv(
    base_url: str, served_model_name: str, tokenizer: str, plan: CachePlan, seed: int,
    result_dir: str, result_filename: str, python: str = sys.executable,
) -> list[str]:  # fmt: skip
    """`vllm bench serve` on the shared-prefix dataset (no test request: it would cache one)."""
    options = {
        "--dataset-name": "prefix_repetition", "--prefix-repetition-prefix-len": plan.prefix_len,
        "--prefix-repetition-suffix-len": plan.suffix_len,
        "--prefix-repetition-num-prefixes": plan.prefixes,
        "--prefix-repetition-output-len": plan.shared_output,
        "--num-prompts": plan.prefixes * plan.per_prefix,
        "--max-concurrency": plan.shared_concurrency, "--seed": seed, "--temperature": 0,
        "--ready-check-timeout-sec": 0, "--percentile-metrics": "ttft,e2el",
        "--metric-percentiles": "50,99",
    }  # fmt: skip
    flags = ["--ignore-eos", "--disable-tqdm"]
    return vllm_bench_argv(
        python, base_url, served_model_name, tokenizer, options, flags, result_dir, result_filename
    )


def held_prefix(plan: CachePlan, index: int) -> list[int]:
    return token_ids(plan.seed + 500 + index, plan.prefix_len)


def held_requests(plan: CachePlan, rnd: int) -> list[tuple[int, list[int]]]:
    """One round of the held-prefix part, in a seeded order: (prefix index, token ids), every
    prefix ``per_prefix`` times, each with a suffix no other request has."""
    base = plan.seed + 10_000 * (rnd + 1)
    out = [(i, held_prefix(plan, i) + token_ids(base + plan.per_prefix * i + k, plan.suffix_len))
           for i in range(plan.prefixes) for k in range(plan.per_prefix)]  # fmt: skip
    random.Random(plan.seed + rnd).shuffle(out)
    return out


def held_ideal(plan: CachePlan, block_size: int) -> int:
    """Hit tokens of one held-prefix run: every request finds its prefix's whole blocks (token
    ids: nothing added)."""
    per_request = prefix_blocks(plan.prefix_len, block_size, 0) * block_size
    return plan.prefixes * plan.per_prefix * per_request
