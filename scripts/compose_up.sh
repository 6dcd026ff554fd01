#!/usr/bin/env bash
# `docker compose [ARGS] up -d --wait`, with a failure told in full: every service that is not
# running and healthy, with its last log lines, then `down` so nothing is left running
# (KEEP_ON_FAILURE=1 keeps the containers for a look). Bounded: UP_TIMEOUT_S (default 1800).
#
# Usage: scripts/compose_up.sh [compose args, e.g. --profile cpu]
# Plain `docker compose up -d --wait` works too; this adds the diagnosis and the clean-up.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
timeout_s="${UP_TIMEOUT_S:-1800}"

die() { printf 'compose_up: error: %s\n' "$*" >&2; exit 2; }

command -v docker >/dev/null 2>&1 || die "no docker CLI on PATH: install Docker Engine"
timeout 20 docker info >/dev/null 2>&1 \
  || die "no Docker engine answers (DOCKER_HOST=${DOCKER_HOST:-unix:///var/run/docker.sock}): start it (scripts/docker_engine.sh ensure on Debian/Ubuntu as root)"
docker compose version >/dev/null 2>&1 \
  || die "the Docker Compose v2 plugin is missing (scripts/docker_engine.sh ensure installs the pinned one)"

status=0
docker compose "$@" up -d --wait --wait-timeout "$timeout_s" || status=$?
[ "$status" -eq 0 ] && exit 0

printf '\ncompose_up: the deployment did not come up (docker compose exited %s). Not healthy:\n' "$status" >&2
# Each service of the selected profiles is asked for on its own: one `ps` snapshot of the whole
# project once lacked a server that was restarting at that moment, and its log lines with it.
# The inner commands read /dev/null, never the loop's list.
while read -r service; do
  read -r state health < <(docker compose "$@" ps -a --format '{{.State}} {{.Health}}' "$service" </dev/null 2>/dev/null | head -n 1) || true
  state="${state:-no container}"
  [ "$state" = running ] && { [ -z "${health:-}" ] || [ "$health" = healthy ]; } && continue
  # keygen is a one-shot: exited is its success, unless it refused (exit 2: a proxy published
  # beyond loopback without keys) or failed, and then its log says why.
  if [ "$service" = keygen ] && [ "$state" = exited ]; then
    code="$(docker compose "$@" ps -a --format '{{.ExitCode}}' keygen </dev/null 2>/dev/null | head -n 1)" || true
    [ "${code:-0}" = 0 ] && continue
  fi
  printf '\n--- %s (%s %s), last log lines:\n' "$service" "$state" "${health:-}" >&2
  docker compose "$@" logs --no-color --tail 30 "$service" </dev/null >&2 || true
done < <(docker compose "$@" config --services 2>/dev/null)
if [ "${KEEP_ON_FAILURE:-0}" = 1 ]; then
  printf '\ncompose_up: KEEP_ON_FAILURE=1: containers kept; "docker compose %s down" removes them\n' "$*" >&2
else
  printf '\ncompose_up: removing what was started (KEEP_ON_FAILURE=1 keeps it)\n' >&2
  docker compose "$@" down --remove-orphans --timeout 20 >&2 || true
fi
exit "$status"
