"""Secrets arrive as files (Compose secrets, a generated key volume, Kubernetes Secrets) so that
neither the Hugging Face token nor the vLLM API key is an environment value visible in
`docker inspect`; they are put into vLLM's own environment inside the process.
"""

from __future__ import annotations

from pathlib import Path

HF_TOKEN_FILE = Path("/run/secrets/kit_secrets/hf_token")
VLLM_KEY_FILE = Path("/run/kit-keys/vllm_api_key")


def read_secret(path: Path) -> str | None:
    try:
        text = path.read_text().strip()
    except (FileNotFoundError, IsADirectoryError):
        return None
    return text.splitlines()[0].strip() if text else None


def secret_environment() -> dict[str, str]:
    """HF_TOKEN and VLLM_API_KEY from their files, each only when its file holds one."""
    out = {}
    token = read_secret(HF_TOKEN_FILE)
    if token:
        out["HF_TOKEN"] = token
    key = read_secret(VLLM_KEY_FILE)
    if key:
        out["VLLM_API_KEY"] = key
    return out
