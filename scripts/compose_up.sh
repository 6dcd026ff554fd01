#!/usr/bin/env bash
# `docker compose [ARGS] up -d`, then wait until the proxy's /health answers 200: the stack's
# readiness (a prefill and a decode backend healthy). `up --wait` would wait for every service, so
# one replica waiting for a slot or held after a crash loop would block it; the proxy already
# routes only to healthy backends. Once ready it names every container that is not (yet).
# A failure is told in full: every service that is not running and healthy, with its last log
# lines, then `down` so nothing is left running (KEEP_ON_FAILURE=1 keeps the containers for a
# look). Bounded: UP_TIMEOUT_S (default 1800) for the proxy to get ready.
#
# Usage: scripts/compose_up.sh [compose args, e.g. --profile cpu]
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
timeout_s="${UP_TIMEOUT_S:-1800}"
poll_s="${UP_POLL_S:-3}"

die() { printf 'compose_up: error: %s\n' "$*" >&2; exit 2; }

case "$timeout_s" in '' | *[!0-9]*) die "UP_TIMEOUT_S=$timeout_s: want whole seconds" ;; esac
command -v docker >/dev/null 2>&1 || die "no docker CLI on PATH: install Docker Engine"
command -v python3 >/dev/null 2>&1 || die "no python3 on PATH: it asks the proxy's /health"
timeout 20 docker info >/dev/null 2>&1 \
  || die "no Docker engine answers (DOCKER_HOST=${DOCKER_HOST:-unix:///var/run/docker.sock}): start it (scripts/docker_engine.sh ensure on Debian/Ubuntu as root)"
docker compose version >/dev/null 2>&1 \
  || die "the Docker Compose v2 plugin is missing (scripts/docker_engine.sh ensure installs the pinned one)"

services="$(docker compose "$@" config --services </dev/null 2>/dev/null)" || services=""

# The proxy service of the selected profiles (proxy-cpu or proxy), or nothing.
proxy_service() {
  local name
  for name in proxy-cpu proxy; do
    grep -qx "$name" <<<"$services" && { echo "$name"; return 0; }
  done
  return 1
}

# The proxy's /health URL on the host, from the port Docker published (a wildcard bind is asked
# on loopback); fails while no port is published (the container is restarting).
health_url() {
  local address host port
  address="$(docker compose "$@" port "$proxy" 8000 </dev/null 2>/dev/null | head -n 1)" || return 1
  port="${address##*:}"
  host="${address%:*}"
  case "$port" in '' | *[!0-9]*) return 1 ;; esac
  case "$host" in '' | 0.0.0.0 | '[::]' | '::') host=127.0.0.1 ;; esac
  printf 'http://%s:%s/health\n' "$host" "$port"
}

# GET $1: prints "CODE BODY" (CODE 0: no answer); exit 0 only on 200. /health is always open
# (no key): orchestrators probe it.
probe() {
  python3 - "$1" <<'PY'
import sys, urllib.error, urllib.request
try:
    with urllib.request.urlopen(sys.argv[1], timeout=5) as r:
        code, body = r.status, r.read()
except urllib.error.HTTPError as e:
    code, body = e.code, e.read()
except Exception as e:
    code, body = 0, str(e).encode()
print(code, body.decode(errors="replace").replace("\n", " ")[:600])
sys.exit(0 if code == 200 else 1)
PY
}

# Every container of the selected services that is not running and healthy, one line each
# ("--- SERVICE NAME (STATE HEALTH)"), with the service's last log lines when $1 is "logs".
# Each service is asked for on its own: one `ps` snapshot of the whole project once lacked a
# server that was restarting at that moment. The inner commands read /dev/null, never the list.
not_ready() {
  local with_logs="$1" service rows name state health code bad
  while read -r service; do
    [ -n "$service" ] || continue
    rows="$(docker compose "${args[@]}" ps -a --format '{{.Name}} {{.State}} {{.Health}}' "$service" </dev/null 2>/dev/null)" || rows=""
    [ -n "$rows" ] || rows="- no-container"
    bad=0
    while read -r name state health; do
      [ "$state" = running ] && { [ -z "${health:-}" ] || [ "$health" = healthy ]; } && continue
      # keygen is a one-shot: exited is its success, unless it refused (exit 2: a proxy
      # published beyond loopback without keys) or failed, and then its log says why.
      if [ "$service" = keygen ] && [ "$state" = exited ]; then
        code="$(docker compose "${args[@]}" ps -a --format '{{.ExitCode}}' keygen </dev/null 2>/dev/null | head -n 1)" || true
        [ "${code:-0}" = 0 ] && continue
      fi
      [ "$state" = no-container ] && state="no container"
      printf -- '--- %s %s (%s %s)\n' "$service" "$name" "$state" "${health:-}" >&2
      bad=1
    done <<<"$rows"
    if [ "$bad" = 1 ] && [ "$with_logs" = logs ]; then
      printf 'last log lines of %s:\n' "$service" >&2
      docker compose "${args[@]}" logs --no-color --tail 30 "$service" </dev/null >&2 || true
    fi
  done <<<"$services"
}

args=("$@")
status=0
docker compose "$@" up -d || status=$?
answer=""
if [ "$status" -eq 0 ]; then
  if ! proxy="$(proxy_service)"; then
    printf 'compose_up: started; no proxy in the selected profiles, so no /health to wait on\n' >&2
    exit 0
  fi
  start=$SECONDS
  url=""
  while :; do
    url="$(health_url "$@")" || url=""
    if [ -n "$url" ] && answer="$(probe "$url")"; then
      printf 'compose_up: ready: %s answered 200 after %ss\n' "$url" "$((SECONDS - start))" >&2
      report="$(not_ready no 2>&1)"
      if [ -n "$report" ]; then
        printf 'compose_up: serving; not ready (yet), the proxy routes around them:\n%s\n' "$report" >&2
        printf 'compose_up: "docker compose %s logs SERVICE" says why\n' "$*" >&2
      fi
      exit 0
    fi
    [ $((SECONDS - start)) -ge "$timeout_s" ] && break
    sleep "$poll_s"
  done
  status=1
  printf '\ncompose_up: the proxy (%s) did not get ready within UP_TIMEOUT_S=%ss; its /health: %s\n' \
    "$proxy" "$timeout_s" "${answer:-no published port (${url:-none})}" >&2
else
  printf '\ncompose_up: the deployment did not come up (docker compose exited %s).\n' "$status" >&2
fi

printf 'Not running and healthy:\n' >&2
not_ready logs
if [ "${KEEP_ON_FAILURE:-0}" = 1 ]; then
  printf '\ncompose_up: KEEP_ON_FAILURE=1: containers kept; "docker compose %s down" removes them\n' "$*" >&2
else
  printf '\ncompose_up: removing what was started (KEEP_ON_FAILURE=1 keeps it)\n' >&2
  docker compose "$@" down --remove-orphans --timeout 20 >&2 || true
fi
exit "$status"
