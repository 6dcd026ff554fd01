"""The model and the token: a model already in the HF cache is fine; a public one is downloaded on
first start; a gated one needs a token in the token file (never printed). Also every secret file
or folder compose.yaml mounts must exist."""

from __future__ import annotations

from pathlib import Path

from pcp_pd_kit.preflight import hfcache
from pcp_pd_kit.preflight.context import Context
from pcp_pd_kit.preflight.memory import GB
from pcp_pd_kit.preflight.report import Result, fail, ok, warn

CHECK = "model"


def model(ctx: Context) -> list[Result]:
    s = ctx.need_settings()
    name, cache = ctx.model_name(), s.path("hf_cache_dir")
    if not ctx.gpu_mode and not s.has("cpu_model_name"):
        return [ok(CHECK, "cpu profile: its model is not checked (no cpu_model_name setting)")]
    env = s.env("model_name" if ctx.gpu_mode else "cpu_model_name")
    if not name:
        return [
            fail(CHECK, f"{env} is empty: set it in {ctx.env_label} to a Hugging Face model id.")
        ]
    if hfcache.is_local_path(name):
        msg = (
            f"{env}={name} is a path inside the containers, which preflight cannot look into: "
            "make sure it is mounted there and holds the model."
        )
        return [warn(CHECK, msg)]
    if hfcache.cached_config(cache, name) is not None:
        return [ok(CHECK, f"model {name} found in the HF cache ({cache})")]
    size = ctx.model_info().size
    about = f" (~{size.weight_bytes / GB:.1f} GB)" if size is not None else ""
    if not hfcache.is_gated(name):
        msg = (
            f"model {name} is not cached yet: the servers will download it{about} into {cache} "
            "on first start (a public model needs no token)"
        )
        return [ok(CHECK, msg)]
    token_file, token_label = s.token_file()
    if hfcache.token_present(token_file):
        msg = (
            f"model {name} is gated and not cached yet; {token_label} holds a token, so the "
            f"servers will download it{about} into {cache} (the token's account must have "
            "accepted the model's licence)"
        )
        return [ok(CHECK, msg)]
    msg = (
        f"model {name} is gated, not in the HF cache ({hfcache.repo_dir(cache, name)}), and "
        f"{token_label} is missing or empty: accept the model's licence on huggingface.co and "
        f"put a token from https://huggingface.co/settings/tokens in {token_file}, or download "
        f"the model first with 'HF_HOME={cache} huggingface-cli download {name}'."
    )
    return [fail(CHECK, msg)]


def secret_files(ctx: Context) -> list[Result]:
    """Compose mounts file secrets (a file or a folder) into the containers; a missing one stops
    `up`."""
    secrets = ctx.view.secrets if ctx.view else {}
    s = ctx.need_settings()
    folder = s.path("secrets_dir") if s.has("secrets_dir") else None
    missing: list[tuple[str, Path]] = []
    present: list[tuple[str, Path]] = []
    for name, spec in sorted(secrets.items()):
        if not isinstance(spec, dict) or not spec.get("file"):
            continue
        path = Path(str(spec["file"]))
        path = path if path.is_absolute() else ctx.compose_file.parent / path
        (present if path.exists() else missing).append((name, path))
    results = []
    for name, path in missing:
        if path == folder:
            make = f"'mkdir -m 700 {path}' (the files in it are optional)"
        else:
            make = f"'install -D -m 600 /dev/null {path}' (empty will do for public models)"
        msg = (
            f"compose.yaml mounts secret '{name}' from {path}, which does not exist: create it "
            f"with {make}."
        )
        results.append(fail("secrets", msg))
    if present and not missing:
        results.append(ok("secrets", "secrets present: " + ", ".join(n for n, _ in present)))
    return results
