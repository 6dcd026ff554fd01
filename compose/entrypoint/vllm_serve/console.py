"""The entrypoint's own lines on stderr, each prefixed ``vllm_serve:`` so a user can grep them
out of vLLM's output (`docker compose logs prefill | grep vllm_serve:`).
"""

from __future__ import annotations

import sys


def log(message: str) -> None:
    print(f"vllm_serve: {message}", file=sys.stderr, flush=True)
