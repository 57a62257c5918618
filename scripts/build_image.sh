#!/usr/bin/env bash
# `make image`: build the Dockerfile with the first container builder that works here
# (Docker engine, Podman, Buildah); say plainly why not when there is none.
set -euo pipefail
cd "$(dirname "$0")/.."
image=${1:-nexus-flow-runtime:dev}

if command -v docker >/dev/null 2>&1; then
  if docker_error=$(docker info 2>&1 >/dev/null); then
    exec docker build --tag "$image" .
  fi
fi
if command -v podman >/dev/null 2>&1; then
  exec podman build --tag "$image" .
fi
if command -v buildah >/dev/null 2>&1; then
  exec buildah bud --tag "$image" .
fi

{
  echo "make image: no container builder on this machine, so no image was built."
  if command -v docker >/dev/null 2>&1; then
    echo "  docker: the client is installed but no Docker engine answers:"
    echo "    $(printf '%s' "${docker_error:-docker info failed}" | grep -v '^\s*$' | tail -n 1)"
  else
    echo "  docker: not installed"
  fi
  echo "  podman, buildah: not installed"
  echo "Build where a builder runs (docker build -t $image .), or install Podman/Buildah."
} >&2
exit 1
