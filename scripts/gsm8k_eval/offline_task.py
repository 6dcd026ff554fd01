"""An lm-eval task identical to the stock ``gsm8k`` but reading local JSONL files.

Why: lm-eval's gsm8k loads ``openai/gsm8k`` from the Hugging Face hub. With GSM8K_DATA_DIR the kit
reads the same rows (test for scoring, train for the 5-shot examples) from disk, so CI and
air-gapped GPU hosts can run the eval. Prompt, stop sequences, filters and metric are the stock
task's, so scores are comparable.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

TASK_NAME = "gsm8k_offline"
SPLITS = ("train", "test")


def check_data_dir(data_dir: Path) -> dict[str, Path]:
    """The split files, after checking they exist and hold GSM8K rows; errors say what to fix."""
    files = {split: data_dir / f"{split}.jsonl" for split in SPLITS}
    for path in files.values():
        if not path.is_file():
            raise FileNotFoundError(
                f"GSM8K_DATA_DIR={data_dir}: {path.name} is missing "
                "(need train.jsonl and test.jsonl with 'question' and 'answer' fields)"
            )
        with path.open(encoding="utf-8") as handle:
            first = handle.readline()
        try:
            row = json.loads(first)
        except ValueError as exc:
            raise ValueError(f"{path}: first line is not JSON") from exc
        if not isinstance(row, dict) or not {"question", "answer"} <= set(row):
            raise ValueError(f"{path}: rows need 'question' and 'answer' fields")
    return files


def task_config(files: dict[str, Path]) -> dict:
    """The task definition (stock gsm8k, version 3.0, with a local json dataset)."""
    return {
        "task": TASK_NAME,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {s: str(p.resolve()) for s, p in files.items()}},
        "output_type": "generate_until",
        "training_split": "train",
        "fewshot_split": "train",
        "test_split": "test",
        "doc_to_text": "Question: {{question}}\nAnswer:",
        "doc_to_target": "{{answer}}",
        "metric_list": [
            {
                "metric": "exact_match",
                "aggregation": "mean",
                "higher_is_better": True,
                "ignore_case": True,
                "ignore_punctuation": False,
                "regexes_to_ignore": [",", "\\$", "(?s).*#### ", "\\.$"],
            }
        ],
        "generation_kwargs": {
            "until": ["Question:", "</s>", "<|im_end|>"],
            "do_sample": False,
            "temperature": 0.0,
        },
        "repeats": 1,
        "num_fewshot": 5,
        "filter_list": [
            {
                "name": "strict-match",
                "filter": [
                    {"function": "regex", "regex_pattern": "#### (\\-?[0-9\\.\\,]+)"},
                    {"function": "take_first"},
                ],
            },
            {
                "name": "flexible-extract",
                "filter": [
                    {
                        "function": "regex",
                        "group_select": -1,
                        "regex_pattern": "(-?[$0-9.,]{2,})|(-?[0-9]+)",
                    },
                    {"function": "take_first"},
                ],
            },
        ],
        "metadata": {"version": 3.0},
    }


def write_task(data_dir: Path, out_dir: Path) -> Path:
    """Write ``<out_dir>/gsm8k_offline.yaml`` for ``lm_eval --include_path out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{TASK_NAME}.yaml"
    path.write_text(yaml.safe_dump(task_config(check_data_dir(data_dir)), sort_keys=False))
    return path
