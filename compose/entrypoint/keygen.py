"""One-shot before the servers start: the vLLM API key, secret files staged for non-root readers.

Why: Compose secrets without Swarm are plain bind mounts that keep the host file's owner and mode,
so a key file made with `umask 077` is unreadable for the proxy (uid 10001) and Grafana (uid 472),
which run without capabilities. This runs once per `docker compose up` as root with only CHOWN and
DAC_READ_SEARCH, and copies each secret into the kit-keys volume, readable by its one consumer.
The vLLM servers' own key is generated here once per deployment; clients never see it.
Standard library only (it runs in the pd-proxy image).
"""

from __future__ import annotations

import os
import secrets
import sys
from pathlib import Path

from bind_policy import refusal

KEYS = Path("/run/kit-keys")
SECRETS = Path("/run/secrets/kit_secrets")
PROXY_UID = 10001
GRAFANA_UID = 472


def write_private(path: Path, data: bytes, uid: int) -> None:
    """Atomically replace ``path`` with ``data``, mode 0400, owned by ``uid`` (a rename, so a
    reader that watches the file sees either the old or the new content, never half)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    os.chmod(tmp, 0o400)
    os.chown(tmp, uid, uid)
    os.replace(tmp, path)


def stage(source: Path, target: Path, uid: int) -> str:
    try:
        data = source.read_bytes()
    except (FileNotFoundError, IsADirectoryError):
        data = b""
    if data.strip():
        if not target.exists() or target.read_bytes() != data:
            write_private(target, data, uid)
        return "staged"
    target.unlink(missing_ok=True)
    return "absent"


def main() -> None:
    key = KEYS / "vllm_api_key"
    if key.exists():
        print("keygen: vLLM API key present")
    else:
        write_private(key, secrets.token_urlsafe(32).encode(), PROXY_UID)
        print("keygen: new vLLM API key in the kit-keys volume")
    for name, target, uid in (
        ("api_keys", KEYS / "api_keys", PROXY_UID),
        ("grafana_admin_password", KEYS / "grafana_admin_password", GRAFANA_UID),
    ):
        print(f"keygen: secrets/{name}: {stage(SECRETS / name, target, uid)}")
    check_binding()


def check_binding() -> None:
    """Refuse (exit 2, before the proxy starts) a proxy published beyond loopback without keys."""
    try:
        keys = (SECRETS / "api_keys").read_text()
    except (FileNotFoundError, IsADirectoryError, UnicodeDecodeError):
        keys = ""
    try:
        why = refusal(os.environ, keys)
    except ValueError as exc:
        why = str(exc)
    if why:
        print(f"keygen: refusing to start the proxy: {why}", file=sys.stderr, flush=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
