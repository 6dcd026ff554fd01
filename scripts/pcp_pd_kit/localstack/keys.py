"""The local stack's client key: what its own requests to the proxy send.

With LOCAL_API_KEY_FILE (or PD_PROXY_API_KEY_FILE in the environment) set, pd-proxy accepts only
the keys in that file, so every request the stack makes itself (the warm-up, the demo's eval,
the report's and Prometheus's reads of the proxy's /metrics) sends the file's first key. The key
never appears on a command line: the eval gets it in its environment (OPENAI_API_KEY, what
lm-eval sends), Prometheus in a credentials file of the run directory, readable by the owner only.
"""

from __future__ import annotations

import os
from pathlib import Path

from pcp_pd_kit.localstack.process import StackProcessError
from pd_proxy.config.key_files import KeyFileError, read_key_file

# The eval's variable for the proxy's key (lm-eval's local-completions and the eval's probe).
EVAL_KEY_VARIABLE = "OPENAI_API_KEY"


def client_key(key_file: str) -> str | None:
    """The first key of ``key_file`` (the proxy's client key file), None when no file is set."""
    if not key_file:
        return None
    try:
        entries = read_key_file(key_file)
    except KeyFileError as exc:
        raise StackProcessError(f"LOCAL_API_KEY_FILE: {exc}") from None
    return entries[0].key


def auth_headers(key: str | None) -> dict[str, str]:
    """The header that carries ``key`` to the proxy ({} without a key)."""
    return {"Authorization": f"Bearer {key}"} if key else {}


def write_credentials(key: str, path: Path) -> Path:
    """``key`` alone in ``path``, mode 0600 (Prometheus's ``credentials_file``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(key)
    path.chmod(0o600)
    return path
