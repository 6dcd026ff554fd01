#!/usr/bin/env bash
# vLLM's serving benchmark (vllm bench serve): a single vLLM instance vs P/D through pd-proxy.
# A thin wrapper over `pcp-pd-kit bench serve`; every option is documented in docs/bench.md.
#
#   scripts/bench_serve.sh                      # local CPU stack: started, measured, stopped
#   scripts/bench_serve.sh --concurrency 1,4 --prompts 16
#   scripts/bench_serve.sh --base-url http://gpu-host:8000 --single-url http://gpu-host:8100 \
#       --api-key-file secrets/api_keys         # a running deployment: nothing is started
#
# PYTHON picks the interpreter (default: the kit's .venv); it needs vLLM for the bench client.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${PYTHON:-$root/.venv/bin/python}"
if [[ ! -x "$py" ]]; then
  echo "bench_serve.sh: no Python at $py: run 'make install' (scripts/bootstrap.sh) or set PYTHON" >&2
  exit 2
fi
cd "$root"
export PYTHONPATH="$root/scripts${PYTHONPATH:+:$PYTHONPATH}"
exec "$py" -m pcp_pd_kit bench serve "$@"
