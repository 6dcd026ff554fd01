"""Build (or keep) the trained demo model and its held-out GSM8K-format task data.

The model has today's tiny model's shape (DeepSeek-V2, MLA + MoE; the same config builder), so the
PCP2 + EP2 prefill and the connector run it as they run the random one; only its weights are
trained, on templated arithmetic problems, so the demo's accuracy can fail. The cache key is the
random model's scheme (a marker file with a fingerprint), over everything that decides the files:
the model and training specs and the source of the generator, the recipe and this builder.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pcp_pd_kit.arith import problems, train
from pcp_pd_kit.localstack import tiny_model

log = logging.getLogger("pcp_pd_kit.arith.build")

SERVED_NAME = "tiny-mla-moe-arith"
DEFAULT_DIR = Path(".models") / SERVED_NAME
# lm-eval's offline GSM8K task reads <dir>/test.jsonl (scored) and <dir>/train.jsonl (few-shot
# pool; the demo runs zero-shot, but the task needs the file).
TASK_DIR = "heldout"
FEWSHOT_ROWS = 10
# Kernels picked by what the CPU offers (ATen's AVX-512 or AVX2 builds, MKL's paths per CPU) round
# differently, and 450 training steps turn that into another model: 0.8867 strict-match on one host,
# 0.9733 on another. ATen's generic kernels and MKL's compatible mode give the same weights on any
# x86-64 host, for about twice the training time. Both are read when torch first runs a kernel, so
# the training runs in an interpreter of its own.
REPRODUCIBLE_ENV = {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE"}


def _model_spec() -> tiny_model.TinyModelSpec:
    # The random model's shape; a small vocabulary (the templates' words, every number one
    # token) and a standard init, since training, not lm_head scaling, makes the logits wide.
    return tiny_model.TinyModelSpec(vocab_size=1024, initializer_range=0.02, lm_head_scale=1.0)


@dataclass(frozen=True)
class ArithModelSpec:
    """Model shape + training recipe; its fingerprint also covers the code that uses them."""

    model: tiny_model.TinyModelSpec = field(default_factory=_model_spec)
    train: train.TrainSpec = field(default_factory=train.TrainSpec)

    def fingerprint(self) -> str:
        sources = [problems.__file__, train.__file__, __file__, tiny_model.__file__]
        blob = json.dumps(asdict(self), sort_keys=True)
        blob += "".join(hashlib.sha256(Path(s).read_bytes()).hexdigest() for s in sources)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def tokenizer_corpus(split: problems.Split) -> list[str]:
    """The training text, plus every number once per line so each stays a single token."""
    numbers = "".join(f" {n}" for n in range(problems.MAX_NUMBER + 1))
    texts = [problems.prompt(p.question) + problems.completion(p.answer) for p in split.train]
    return texts + [numbers] * 50


def check_number_tokens(tokenizer: Any) -> None:
    """Every ' N' the problems can hold is one token: the model looks sums up, not carries."""
    split = [
        n
        for n in range(problems.MAX_NUMBER + 1)
        if len(tokenizer(f" {n}", add_special_tokens=False)["input_ids"]) != 1
    ]
    if split:
        raise RuntimeError(f"numbers split over several tokens: {split[:10]}")


def write_task_data(split: problems.Split, folder: Path) -> Path:
    """The held-out questions as GSM8K JSONL rows, for lm-eval's GSM8K task."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = {"test": split.heldout, "train": split.train[:FEWSHOT_ROWS]}
    for name, chosen in rows.items():
        lines = (json.dumps(p.row()) + "\n" for p in chosen)
        (folder / f"{name}.jsonl").write_text("".join(lines), encoding="utf-8")
    return folder


def _make(spec: ArithModelSpec, folder: Path) -> dict[str, Any]:
    import torch
    from transformers import AutoTokenizer, DeepseekV2ForCausalLM

    t0 = time.monotonic()
    rs = spec.train
    data = problems.split(rs.seed, rs.n_train, rs.n_heldout)
    ms = spec.model
    tiny_model.train_tokenizer(
        tokenizer_corpus(data), ms.vocab_size, ms.max_position_embeddings, folder
    )
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    check_number_tokens(tokenizer)
    ids = (tokenizer.bos_token_id, tokenizer.eos_token_id)
    narrow = dataclasses.replace(ms, kv_lora_rank=rs.kv_lora_rank)
    torch.manual_seed(ms.seed)
    model = DeepseekV2ForCausalLM(tiny_model.deepseek_config(narrow, *ids)).to(torch.float32)
    examples = [train.encode(p, tokenizer, tokenizer.eos_token_id) for p in data.train]
    loss = train.train(model, examples, rs, tokenizer.pad_token_id)
    served = DeepseekV2ForCausalLM(tiny_model.deepseek_config(ms, *ids)).to(torch.float32)
    train.widen(model, served)
    served.eval().save_pretrained(str(folder), safe_serialization=True)
    write_task_data(data, folder / TASK_DIR)
    seconds = time.monotonic() - t0
    log.info("trained in %.0fs, final loss %.4f", seconds, loss)
    return {"final_loss": round(loss, 4), "build_seconds": round(seconds, 1)}


def _make_reproducibly(spec: ArithModelSpec, folder: Path) -> dict[str, Any]:
    """_make in a fresh interpreter under REPRODUCIBLE_ENV (its log goes to our stderr)."""
    argv = [sys.executable, "-m", "pcp_pd_kit.arith.build", "--make-into", str(folder)]
    proc = subprocess.run(argv, input=json.dumps(asdict(spec)), stdout=subprocess.PIPE, text=True,
                          env={**os.environ, **REPRODUCIBLE_ENV}, check=False)  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"training the demo model failed (exit {proc.returncode}, log above)")
    stats: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return stats


def spec_from_json(text: str) -> ArithModelSpec:
    data = json.loads(text)
    model = tiny_model.TinyModelSpec(**data["model"])
    return ArithModelSpec(model=model, train=train.TrainSpec(**data["train"]))


def build(out_dir: Path, spec: ArithModelSpec | None = None) -> Path:
    """Build (or keep) the trained model in out_dir and return its path."""
    chosen = spec or ArithModelSpec()
    stats: dict[str, Any] = {}
    record = {"spec": asdict(chosen), "trained": stats}

    def make(folder: Path) -> None:
        stats.update(_make_reproducibly(chosen, folder))

    return tiny_model.build_into(out_dir, chosen, record, make)


def task_dir(model_dir: Path) -> Path:
    """Where build() wrote the held-out task's JSONL files."""
    return model_dir / TASK_DIR


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pcp_pd_kit.arith.build", description=__doc__)
    parser.add_argument("--out", type=Path, default=DEFAULT_DIR, help="output directory")
    # build()'s own call: the spec as JSON on stdin, the stats as JSON on stdout.
    parser.add_argument("--make-into", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    if args.make_into is None:
        print(build(args.out))
        return 0
    wrong = {k: os.environ.get(k) for k, v in REPRODUCIBLE_ENV.items() if os.environ.get(k) != v}
    if wrong:
        parser.error(f"--make-into runs only under {REPRODUCIBLE_ENV}, not {wrong}")
    print(json.dumps(_make(spec_from_json(sys.stdin.read()), args.make_into)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
