#!/usr/bin/env bash
# Checks a GPU host before `docker compose up`: Docker Compose v2, the NVIDIA container runtime,
# enough GPUs for prefill (TP x PCP) + decode (TP), the configured GPU ids, free host ports, and
# the model in the Hugging Face cache or an HF_TOKEN to fetch it. Every failure is one sentence
# saying what is wrong and how to fix it; the exit status is the number of failures (capped at 100).
#
# Usage: scripts/preflight.sh [--env-file FILE]
# Settings come from the process environment, then FILE (default: .env), then .env.example: the
# same values compose sees with `--env-file .env` (its ${VAR:-default}s equal .env.example).
# COMPOSE_PROFILES=cpu skips the GPU checks.
# Test hooks: PREFLIGHT_DOCKER and PREFLIGHT_NVIDIA_SMI name the commands to call.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
env_file="$ROOT/.env"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --env-file)
      [[ $# -ge 2 ]] || { echo "preflight: --env-file needs a path" >&2; exit 100; }
      env_file="$2"; shift 2 ;;
    -h|--help) sed -n '2,11p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "preflight: unknown argument '$1' (see --help)" >&2; exit 100 ;;
  esac
done

DOCKER="${PREFLIGHT_DOCKER:-docker}"
NVIDIA_SMI="${PREFLIGHT_NVIDIA_SMI:-nvidia-smi}"
failures=0

ok() { printf 'ok    %s\n' "$*"; }
fail() { printf 'FAIL  %s\n' "$*"; failures=$((failures + 1)); }

# Read KEY=VALUE lines without executing them; a variable already set wins (env > .env > example).
load_env() {
  local file="$1" line key value
  [[ -f "$file" ]] || return 0
  while IFS= read -r line || [[ -n "$line" ]]; do
    [[ "$line" =~ ^[[:space:]]*(export[[:space:]]+)?([A-Za-z_][A-Za-z0-9_]*)=(.*)$ ]] || continue
    key="${BASH_REMATCH[2]}"
    value="${BASH_REMATCH[3]}"
    if [[ "$value" =~ ^\"(.*)\"[[:space:]]*(#.*)?$ || "$value" =~ ^\'(.*)\'[[:space:]]*(#.*)?$ ]]; then
      value="${BASH_REMATCH[1]}"
    else
      value="${value%%[[:space:]]#*}"
      value="${value%"${value##*[![:space:]]}"}"
    fi
    [[ -n "${!key+set}" ]] || export "$key=$value"
  done <"$file"
}
if [[ "$env_file" != "$ROOT/.env" && ! -f "$env_file" ]]; then
  echo "preflight: env file $env_file does not exist" >&2
  exit 100
fi
load_env "$env_file"
load_env "$ROOT/.env.example"

is_uint() { [[ "$1" =~ ^[0-9]+$ ]]; }

# --- Docker Compose v2 ------------------------------------------------------------------------
check_compose() {
  if ! command -v "$DOCKER" >/dev/null 2>&1; then
    fail "docker is not installed (no '$DOCKER' on PATH): install Docker Engine, https://docs.docker.com/engine/install/."
    return 1
  fi
  local version
  if ! version="$("$DOCKER" compose version --short 2>/dev/null)"; then
    fail "Docker Compose v2 is missing ('docker compose version' failed): install the docker-compose-plugin package, https://docs.docker.com/compose/install/linux/."
    return 0
  fi
  version="${version#v}"
  if [[ "${version%%.*}" =~ ^[0-9]+$ ]] && (( ${version%%.*} >= 2 )); then
    ok "Docker Compose $version"
  else
    fail "Docker Compose is version '$version', the compose files need v2 or later: install the docker-compose-plugin package."
  fi
}

# --- NVIDIA runtime and GPUs -------------------------------------------------------------------
check_nvidia_runtime() {
  local runtimes
  if ! runtimes="$("$DOCKER" info --format '{{json .Runtimes}}' 2>/dev/null)"; then
    fail "'docker info' failed, so the Docker daemon is not reachable: start it (sudo systemctl start docker) or add your user to the docker group."
    return 0
  fi
  if [[ "$runtimes" == *nvidia* ]]; then
    ok "NVIDIA container runtime registered with Docker"
  else
    fail "Docker has no NVIDIA runtime, so containers cannot see GPUs: install the NVIDIA Container Toolkit and run 'sudo nvidia-ctk runtime configure --runtime=docker && sudo systemctl restart docker'."
  fi
}

check_gpus() {
  local tp="${PREFILLER_TP_SIZE:-1}" pcp="${PREFILLER_PCP_SIZE:-2}" dtp="${DECODER_TP_SIZE:-1}"
  local name
  for name in PREFILLER_TP_SIZE PREFILLER_PCP_SIZE DECODER_TP_SIZE; do
    if ! is_uint "${!name:-1}" || (( ${!name:-1} < 1 )); then
      fail "$name='${!name}' is not a positive integer: fix it in .env."
      return 0
    fi
  done
  local need=$(( tp * pcp + dtp ))
  if ! command -v "$NVIDIA_SMI" >/dev/null 2>&1; then
    fail "nvidia-smi is not installed, so no NVIDIA driver is visible: install the NVIDIA driver for your GPUs (or use COMPOSE_PROFILES=cpu)."
    return 0
  fi
  local ids
  if ! ids="$("$NVIDIA_SMI" --query-gpu=index --format=csv,noheader 2>/dev/null)"; then
    fail "nvidia-smi failed, so the NVIDIA driver is not working: check 'nvidia-smi' output and reinstall or reload the driver."
    return 0
  fi
  local -a present=()
  mapfile -t present < <(printf '%s\n' "$ids" | tr -d ' ' | grep -E '^[0-9]+$' || true)
  local have=${#present[@]}
  if (( have < need )); then
    fail "found $have GPU(s) but prefill needs PREFILLER_TP_SIZE x PREFILLER_PCP_SIZE = $tp x $pcp = $(( tp * pcp )) and decode DECODER_TP_SIZE = $dtp, $need in all: use a bigger host or lower those sizes in .env."
  else
    ok "$have GPU(s) for $need needed (prefill $tp x $pcp, decode $dtp)"
  fi

  # The compose file lists one PREFILLER_GPU_n / DECODER_GPU_n per slot.
  local compose_file="$ROOT/compose/docker-compose.yml" slots_p slots_d
  slots_p="$(grep -oE 'PREFILLER_GPU_[0-9]+' "$compose_file" | sort -u | wc -l)"
  slots_d="$(grep -oE 'DECODER_GPU_[0-9]+' "$compose_file" | sort -u | wc -l)"
  if (( slots_p != tp * pcp )); then
    fail "compose/docker-compose.yml reserves $slots_p prefill GPU(s) but TP x PCP = $(( tp * pcp )): list PREFILLER_GPU_0..$(( tp * pcp - 1 )) in the prefill device_ids and set them in .env."
  fi
  if (( slots_d != dtp )); then
    fail "compose/docker-compose.yml reserves $slots_d decode GPU(s) but DECODER_TP_SIZE = $dtp: list DECODER_GPU_0..$(( dtp - 1 )) in the decode device_ids and set them in .env."
  fi
  local -A used=()
  local var id
  local -a slot_vars=()
  mapfile -t slot_vars < <(grep -oE '(PREFILLER|DECODER)_GPU_[0-9]+' "$compose_file" | sort -u)
  for var in "${slot_vars[@]}"; do
    id="${!var:-}"
    if [[ -z "$id" ]]; then
      fail "$var is not set: set it in .env to a GPU id from 'nvidia-smi -L'."
      continue
    fi
    if [[ -n "${used[$id]:-}" ]]; then
      fail "GPU $id is given to both $var and ${used[$id]}: give each slot its own GPU id in .env."
    fi
    used[$id]="$var"
    if ! printf '%s\n' "${present[@]}" | grep -qx -- "$id"; then
      fail "$var=$id but nvidia-smi lists GPU ids ${present[*]:-none}: set $var in .env to one of them."
    fi
  done
}

# --- host ports --------------------------------------------------------------------------------
check_ports() {
  local spec name port default busy=0
  for spec in PREFILL_PORT:8100 DECODE_PORT:8200 PROXY_PORT:8000 PROMETHEUS_PORT:9090 GRAFANA_PORT:3000; do
    name="${spec%%:*}"
    default="${spec#*:}"
    port="${!name:-$default}"
    if ! is_uint "$port" || (( port < 1 || port > 65535 )); then
      fail "$name='$port' is not a TCP port: set it in .env."
      busy=1
      continue
    fi
    if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
      fail "port $port ($name) is already in use on this host: stop whatever listens there (ss -ltnp 'sport = :$port') or set $name in .env."
      busy=1
    fi
  done
  (( busy )) || ok "host ports free"
}

# --- model weights -----------------------------------------------------------------------------
check_model() {
  local profiles="${COMPOSE_PROFILES:-gpu}" model
  if [[ ",$profiles," == *,cpu,* ]]; then model="${CPU_MODEL_NAME:-Qwen/Qwen2.5-0.5B-Instruct}"
  else model="${MODEL_NAME:-deepseek-ai/DeepSeek-V2-Lite-Chat}"; fi
  local cache="${HF_CACHE_DIR:-$HOME/.cache/huggingface}"
  cache="${cache/#\~/$HOME}"
  local snapshots="$cache/hub/models--${model//\//--}/snapshots"
  if [[ -d "$snapshots" ]] && [[ -n "$(ls -A "$snapshots" 2>/dev/null)" ]]; then
    ok "model $model found in the HF cache ($cache)"
  elif [[ -n "${HF_TOKEN:-}" ]]; then
    ok "model $model not cached yet; HF_TOKEN is set, so the servers will download it into $cache"
  else
    fail "model $model is not in the Hugging Face cache ($snapshots) and HF_TOKEN is empty: set HF_TOKEN in .env (https://huggingface.co/settings/tokens) or download it first with 'HF_HOME=$cache huggingface-cli download $model'."
  fi
}

if check_compose; then
  if [[ ",${COMPOSE_PROFILES:-gpu}," == *,cpu,* && ",${COMPOSE_PROFILES:-gpu}," != *,gpu,* ]]; then
    ok "COMPOSE_PROFILES=${COMPOSE_PROFILES}: GPU checks skipped"
  else
    check_nvidia_runtime
  fi
fi
if [[ ",${COMPOSE_PROFILES:-gpu}," == *,gpu,* ]]; then
  check_gpus
fi
check_ports
check_model

if (( failures )); then
  printf '\n%d check(s) failed: fix the lines marked FAIL, then run scripts/preflight.sh again.\n' "$failures"
  exit $(( failures > 100 ? 100 : failures ))
fi
printf '\nall checks passed: docker compose --env-file .env -f compose/docker-compose.yml up -d\n'
