#!/usr/bin/env bash
# Checks a GPU host before `docker compose up` and exits with the number of FAILs (at most 100).
# The checks live in scripts/pcp_pd_kit/preflight/ (standard library only, so the host's python3 runs
# them without the kit's venv); see docs/preflight.md or `scripts/preflight.sh --help`.
#
# Usage: scripts/preflight.sh [--env-file FILE] [--profile NAME] [--json]
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PYTHONPATH="$ROOT/scripts"
exec python3 -m pcp_pd_kit.preflight "$@"
