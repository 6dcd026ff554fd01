#!/usr/bin/env bash
# Builds pd-proxy for Kubernetes and pushes it to your registry, which the cluster pulls it from (no
# public registry serves it): the compose build (compose/images/proxy.Dockerfile, official
# python:3.11-slim base, pip from your index), tagged REGISTRY/pcp-pd-kit/pd-proxy:TAG. Prints the
# `images:` entry to put in your overlay; `make k8s-check` then confirms no placeholder is left.
#
#   make k8s-proxy-image REGISTRY=registry.mycorp.example[/path] [TAG=...] [PUSH=0]
#
# REGISTRY  required: where the cluster's nodes pull from (`docker login` to it first).
# TAG       default: the tag deploy/k8s/base/proxy.yaml names (the version compose builds).
# PUSH=0    build and tag only (push it yourself, e.g. from another machine).
# KIT_EXTRA_CA_CERTS as for scripts/images.sh is not applied here: copy your CAs into
# compose/images/ca/ first if pip needs them.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MANIFEST="$ROOT/deploy/k8s/base/proxy.yaml"
PLACEHOLDER="registry.example.com"

die() { printf '[k8s-proxy-image] ERROR: %s\n' "$*" >&2; exit 1; }
log() { printf '[k8s-proxy-image] %s\n' "$*" >&2; }

# The base manifest's image (name:tag), the one place the Kubernetes side names it.
base_image() {
  sed -n 's/^ *image: *\(pcp-pd-kit\/pd-proxy:[^ ]*\) *$/\1/p' "$MANIFEST" | head -n 1
}

main() {
  local registry="${REGISTRY:-}" base name tag image push="${PUSH:-1}"
  registry="${registry%/}"
  [ -n "$registry" ] || die "set REGISTRY to the registry your cluster pulls from, e.g. make k8s-proxy-image REGISTRY=registry.mycorp.example/ml"
  case "$registry" in
    "$PLACEHOLDER"|"$PLACEHOLDER"/*) die "REGISTRY=$registry is the kit's placeholder, which no registry serves: name yours" ;;
    *[[:space:]]*|*://*) die "REGISTRY=$registry is not a registry host[:port][/path]" ;;
  esac
  case "$push" in 0|1) ;; *) die "PUSH must be 1 (push, the default) or 0 (build only), not '$push'" ;; esac
  base="$(base_image)"
  [ -n "$base" ] || die "no pcp-pd-kit/pd-proxy image in $MANIFEST"
  name="${base%:*}"
  tag="${TAG:-${base##*:}}"
  [[ "$tag" =~ ^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$ ]] || die "TAG=$tag is not a valid image tag"
  image="$registry/$name:$tag"
  command -v docker >/dev/null 2>&1 || die "docker not found (make engine starts one)"
  cd "$ROOT"
  log "building $image from compose/images/proxy.Dockerfile"
  DOCKER_BUILDKIT=0 docker build -f compose/images/proxy.Dockerfile -t "$image" . \
    || die "docker build failed (output above)"
  if [ "$push" = 1 ]; then
    log "pushing $image"
    docker push "$image" || die "docker push $image failed: docker login $registry, or PUSH=0 and push it yourself"
  fi
  # Two entries: the base's name (a copy of a kit overlay, its placeholder entry replaced) and the
  # placeholder the kit's overlays rename it to (an overlay built on one of them).
  cat <<SNIPPET
# For your overlay's kustomization.yaml (then: make k8s-check OVERLAY=<your overlay>):
images:
  - name: $name
    newName: $registry/$name
    newTag: "$tag"
  - name: $PLACEHOLDER/$name
    newName: $registry/$name
    newTag: "$tag"
SNIPPET
}

main "$@"
