"""Preflight for the kit's GPU compose stack: checks a host before `docker compose up`.

Runs with the host's system python3 (no venv), so every module here uses only the standard
library. Entry point: `python3 -m pcp_pd_kit.preflight` (scripts/preflight.sh sets PYTHONPATH).
"""

from __future__ import annotations

#: The vLLM release whose rules (MoE backends, NIXL import) the checks encode.
VLLM_VERSION = "0.32.0"
