"""The Hugging Face cache the servers share (HF_CACHE_DIR, mounted as HF_HOME): whether a model is
already there, how many of its bytes are, whether it is gated, and whether a token file exists."""

from __future__ import annotations

from pathlib import Path

#: Organisations whose models need an accepted licence and a token to download. Others are
#: treated as public; a gated model outside this list fails at download with HTTP 401/403.
GATED_PREFIXES = ("meta-llama/", "mistralai/", "google/gemma", "cohereforai/", "coherelabs/")


def repo_dir(cache: Path, model: str) -> Path:
    """Where huggingface_hub keeps `org/name` under HF_HOME: hub/models--org--name."""
    return cache / "hub" / ("models--" + model.replace("/", "--"))


def cached_config(cache: Path, model: str) -> Path | None:
    """The newest snapshot's config.json, if any snapshot has one."""
    snapshots = repo_dir(cache, model) / "snapshots"
    try:
        found = [p / "config.json" for p in snapshots.iterdir() if (p / "config.json").is_file()]
    except OSError:
        return None
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


def cached_bytes(cache: Path, model: str) -> int:
    """Bytes of the model's finished blobs (partial `.incomplete` downloads do not count)."""
    try:
        blobs = list((repo_dir(cache, model) / "blobs").iterdir())
        done = [b for b in blobs if b.is_file() and not b.name.endswith(".incomplete")]
        return sum(b.stat().st_size for b in done)
    except OSError:
        return 0


def is_gated(model: str) -> bool:
    return model.lower().startswith(GATED_PREFIXES)


def is_local_path(model: str) -> bool:
    """A path inside the container rather than a hub id: preflight cannot look into it."""
    return model.startswith(("/", "./", "../", "~"))


def token_present(path: Path) -> bool:
    """A token file counts when it holds something besides whitespace (never read out)."""
    try:
        return bool(path.read_text(encoding="utf-8", errors="replace").strip())
    except OSError:
        return False
