#!/usr/bin/env bash
# `make test` (and CI): the whole suite. The cpu profile's images build in the background (minutes
# on a new machine, mostly pip and Docker unpacking) while lint and the tests that start no live
# stack run; the live suites (local vLLM stacks, then the compose cpu profile) run after it, on a
# machine with nothing else to do. Extra arguments go to both pytest runs. Each run writes a
# JUnit file under run/ (junit-unit.xml, junit-live.xml). The engine is stopped at the end where
# the kit started it.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 1
PY="${VENV:-.venv}/bin/python"
mkdir -p run
log() { printf '[test] %s\n' "$*" >&2; }
elapsed() { echo "$(( $(date +%s) - $1 ))s"; }

status=0
t0=$(date +%s)
if ! bash scripts/docker_engine.sh ensure; then
  exit 1
fi
log "building the images in the background (log: run/images.log)"
bash scripts/images.sh >run/images.log 2>&1 &
images=$!
trap 'kill "$images" 2>/dev/null || true; bash scripts/docker_engine.sh stop || true' EXIT

"$PY" -m ruff check . && "$PY" -m ruff format --check . && "$PY" -m mypy \
  && "$(dirname "$PY")/lint-imports" || status=1
log "lint done ($(elapsed "$t0")); the tests that start no live stack"
"$PY" -m pytest -ra --durations=15 -m "not e2e and not compose" \
  --junitxml=run/junit-unit.xml "$@" || status=1

if wait "$images"; then
  grep "^\[images\]" run/images.log >&2 || true
  log "images ready ($(elapsed "$t0")); the live suites"
  "$PY" -m pytest -ra --durations=15 -m "e2e or compose" \
    --junitxml=run/junit-live.xml "$@" || status=1
else
  tail -n 30 run/images.log >&2
  log "the images did not build (above; full log run/images.log): the live suites did not run"
  status=1
fi
log "done in $(elapsed "$t0"), exit $status"
exit "$status"
