#!/usr/bin/env bash
# GSM8K accuracy through the P/D proxy, pass/fail against the expected score: a thin wrapper around
# `pcp-pd-kit eval` (scripts/pcp_pd_kit/gsm8k/), which runs lm-eval in process and writes
# results.json + manifest.json. Exit 0 = pass, 1 = score outside the band, 2 = any error.
#
# Usage: scripts/eval_gsm8k.sh [--base-url URL] [--model NAME] [--limit N] [--num-concurrent N]
#          [--num-fewshot N] [--output-dir DIR] [--data-dir DIR] [--prefill-url URL]
#          [--decode-url URL] [--max-gen-toks N]
# See --help for the environment variables. PYTHON picks the interpreter (default: the kit's
# .venv, else python3).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
if ! command -v "$PYTHON" >/dev/null 2>&1; then
  printf "eval_gsm8k: error: python not found ('%s'); run scripts/bootstrap.sh or set PYTHON\n" \
    "$PYTHON" >&2
  exit 2
fi
export PYTHONPATH="$ROOT/scripts${PYTHONPATH:+:$PYTHONPATH}"
exec "$PYTHON" -m pcp_pd_kit eval "$@"
