"""Decide which model the stack serves: the tiny built one, a local path, or a cached HF id.

Nothing can be downloaded on CI, so an HF id must already be in the local cache; saying so up
front beats a vLLM start-up that dies minutes later on a network error.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pcp_pd_kit.localstack import tiny_model

_HF_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class ModelNotAvailableError(RuntimeError):
    """MODEL names something that is neither a local model directory nor a cached HF id."""


@dataclass(frozen=True)
class ResolvedModel:
    """What to pass to --model and --served-model-name."""

    path: str
    served_name: str
    built_tiny: bool = False


def hf_cached(model_id: str) -> bool:
    """True when the HF cache already holds the model's config.json; False for anything that is
    no repo id (a server's own path such as the compose cpu profile's /models/tiny-mla-moe)."""
    try:
        from huggingface_hub import try_to_load_from_cache
        from huggingface_hub.errors import HFValidationError
    except ImportError:
        return False
    try:
        found = try_to_load_from_cache(model_id, "config.json")
    except HFValidationError:
        return False
    return isinstance(found, str)


def tokenizer_folder(
    model_path: str, cached_file: Callable[[str, str], str | None] | None = None
) -> str | None:
    """The folder holding the model's ``tokenizer.json`` (a model directory, or the HF cache's
    snapshot of a cached id), for pd-proxy's ``--tokenizer``; None when there is none (the proxy
    then asks decode's ``/tokenize``)."""
    local = Path(model_path)
    if local.is_dir():
        return str(local) if (local / "tokenizer.json").is_file() else None
    found = (cached_file or _hf_cached_file)(model_path, "tokenizer.json")
    return str(Path(found).parent) if found else None


def _hf_cached_file(model_id: str, filename: str) -> str | None:
    try:
        from huggingface_hub import try_to_load_from_cache
        from huggingface_hub.errors import HFValidationError
    except ImportError:
        return None
    try:
        found = try_to_load_from_cache(model_id, filename)
    except HFValidationError:
        return None
    return found if isinstance(found, str) else None


def resolve_model(
    model: str,
    served_model_name: str,
    repo: Path,
    build_tiny: Callable[[Path], Path] = tiny_model.build,
    is_cached: Callable[[str], bool] = hf_cached,
) -> ResolvedModel:
    """Empty MODEL -> build the tiny model under .models/; a path -> it; an HF id -> if cached."""
    if not model:
        path = build_tiny(repo / tiny_model.DEFAULT_DIR)
        return ResolvedModel(
            str(path), served_model_name or tiny_model.SERVED_NAME, built_tiny=True
        )
    candidate = Path(model).expanduser()
    if not candidate.is_absolute():
        candidate = (repo / candidate) if (repo / candidate).exists() else candidate.resolve()
    if candidate.exists():
        if not (candidate / "config.json").is_file():
            raise ModelNotAvailableError(f"MODEL={model}: {candidate} has no config.json")
        return ResolvedModel(str(candidate), served_model_name or candidate.name)
    if _HF_ID.match(model):
        if is_cached(model):
            return ResolvedModel(model, served_model_name or model)
        raise ModelNotAvailableError(
            f"MODEL={model}: not in the local Hugging Face cache and this stack never downloads. "
            f"Fetch it first (`huggingface-cli download {model}`) or leave MODEL empty for the "
            "built-in tiny model."
        )
    raise ModelNotAvailableError(
        f"MODEL={model}: no such directory, and not an HF id of the form owner/name"
    )
