#!/usr/bin/env bash
# Make the local base image diloco-base:bookworm: Debian bookworm (minbase) with Python 3.11 and
# its venv module, from Debian's package archive, for machines that reach no image registry
# (the Dockerfile's default base, python:3.11-slim, comes from Docker Hub). Needs root and
# debootstrap (installed with apt-get when missing). An image already there is kept.
set -euo pipefail
IMAGE=${1:-diloco-base:bookworm}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
if docker image inspect "$IMAGE" >/dev/null 2>&1; then
    echo "base image $IMAGE: already there"
    exit 0
fi
if ! command -v debootstrap >/dev/null 2>&1; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null
fi
root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT
echo "base image $IMAGE: debootstrap bookworm from $MIRROR (about a minute)"
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
    bookworm "$root" "$MIRROR" >/dev/null
tar -C "$root" -c . | docker import -c 'CMD ["/bin/bash"]' - "$IMAGE" >/dev/null
echo "base image $IMAGE: made"
