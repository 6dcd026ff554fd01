"""lm-eval's own ``gsm8k`` task, reading local JSONL files instead of the Hugging Face hub.

Why: the stock task loads ``openai/gsm8k`` from the hub. With GSM8K_DATA_DIR the kit reads the same
rows (test for scoring, train for the few-shot examples) from disk, so CI and air-gapped GPU hosts
can run the eval. The task file *includes* lm-eval's gsm8k.yaml and overrides only the task name
and the dataset fields, so the prompt, stop sequences, filters, few-shot split and metric are the
installed lm-eval's, whatever its version, and scores stay comparable with the stock task.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

TASK_NAME = "gsm8k_offline"
SPLITS = ("train", "test")
# The only stock fields the offline task replaces (besides its name).
DATASET_FIELDS = ("dataset_path", "dataset_name", "dataset_kwargs")


def stock_task_yaml() -> Path:
    """The installed lm-eval's gsm8k.yaml (its task index finds the same file, only slower)."""
    spec = importlib.util.find_spec("lm_eval.tasks")
    roots = list(spec.submodule_search_locations or []) if spec else []
    for root in roots:
        path = Path(root) / "gsm8k" / "gsm8k.yaml"
        if path.is_file():
            return path.resolve()
    raise FileNotFoundError(
        f"the installed lm-eval has no tasks/gsm8k/gsm8k.yaml (looked in {roots})"
    )


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


def task_config(files: dict[str, Path]) -> dict[str, Any]:
    """The task file's content: include the stock gsm8k, replace its name and dataset only."""
    return {
        "include": str(stock_task_yaml()),
        "task": TASK_NAME,
        "dataset_path": "json",
        "dataset_name": None,  # the stock "main" is a hub config name; local json has none
        "dataset_kwargs": {"data_files": {s: str(p.resolve()) for s, p in files.items()}},
    }


def write_task(data_dir: Path, out_dir: Path) -> Path:
    """Write ``<out_dir>/gsm8k_offline.yaml``, for ``TaskManager(include_path=out_dir)``."""
    import yaml  # lm-eval's dependency; imported late so --help and arg errors work without it

    config = task_config(check_data_dir(data_dir))
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{TASK_NAME}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path
