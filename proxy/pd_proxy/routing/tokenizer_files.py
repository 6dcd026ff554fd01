"""Where ``--tokenizer`` finds the tokenizer files: a folder, or a Hugging Face model id looked up
in the Hugging Face cache the vLLM servers download into (mounted read-only in the proxy).

vLLM's ``--model org/name`` leaves ``hub/models--org--name/refs/main`` (the revision) and
``snapshots/<revision>/`` (the files) under ``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else
``~/.cache/huggingface/hub``. Until the first start has downloaded them the id resolves to None:
the caller waits for them. Reads the file system only.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

from pd_proxy.routing.tokenizer import TokenizerFilesError

MODEL_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


def hub_cache(env: Mapping[str, str]) -> Path:
    """The hub cache folder, as huggingface_hub finds it."""
    if env.get("HF_HUB_CACHE"):
        return Path(env["HF_HUB_CACHE"])
    home = env.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    return Path(home) / "hub"


def is_model_id(value: str) -> bool:
    """``org/name`` that is not an existing path: a Hugging Face model id."""
    return bool(MODEL_ID.match(value)) and not Path(value).exists()


def tokenizer_folder(value: str, env: Mapping[str, str]) -> Path | None:
    """The folder holding ``value``'s tokenizer.json; None for a model id whose files are not in
    the cache yet. TokenizerFilesError for a path that is no folder."""
    if not is_model_id(value):
        folder = Path(value)
        if not folder.is_dir():
            raise TokenizerFilesError(f"{value}: no such folder (nor an org/name model id)")
        return folder
    repo = hub_cache(env) / ("models--" + value.replace("/", "--"))
    try:
        revision = (repo / "refs" / "main").read_text().strip()
    except OSError:
        return None
    folder = repo / "snapshots" / revision
    return folder if (folder / "tokenizer.json").is_file() else None
