# One image for every service of a compose cluster (docker-compose.yml): `diloco broker`,
# `gateway`, `controller`, and the `outer`, `learner` and `link` containers the controller starts.
#
# The base is python:3.11-slim-bookworm (Debian 12); any Debian-like image with Python 3.11+ and
# its venv module will do: `docker build --build-arg BASE_IMAGE=diloco-base:bookworm .`
# (docker/base-image.sh makes that one from Debian's archive, where no image registry is
# reachable). Pin the base by digest (python:3.11-slim-bookworm@sha256:...) for builds that must
# be repeatable byte for byte; the Python packages are pinned with their hashes either way.
ARG BASE_IMAGE=python:3.11-slim-bookworm
FROM ${BASE_IMAGE}
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH \
    DILOCO_JAX_CACHE=/cache/jax NUMBA_CACHE_DIR=/opt/diloco/numba-cache
# A network that re-signs HTTPS needs its CA certificates for pip: docker/ca-certificates/*.crt,
# which holds none in a normal build (see docker/ca-certificates/README.md).
COPY docker/ca-certificates/ /usr/local/share/ca-certificates/
RUN if ls /usr/local/share/ca-certificates/*.crt >/dev/null 2>&1; then \
        update-ca-certificates \
        && printf '[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n' > /etc/pip.conf; \
    fi \
    && python3 -m venv /opt/venv \
    && useradd --system --uid 10001 --user-group --create-home --home-dir /home/diloco diloco
# The runtime dependencies, exactly as locked (with their hashes), in a layer of their own:
# rebuilt only when requirements-runtime.lock changes, not on every source edit. nats-server is
# one of them; the test and lint tools of requirements.lock are not.
COPY requirements-runtime.lock /src/
RUN pip install -r /src/requirements-runtime.lock
COPY pyproject.toml README.md /src/
COPY shared /src/shared
COPY services /src/services
# The project itself, nothing resolved again; the source copy is then removed, so that every
# process imports the installed package. The folders the services write are the user's: the
# named volumes mounted there start with this ownership.
RUN pip install --no-deps /src && rm -rf /src \
    && mkdir -p /cache/jax /data /secrets /units "$NUMBA_CACHE_DIR" \
    && chown diloco:diloco /cache/jax /data /secrets /units "$NUMBA_CACHE_DIR"
USER diloco
WORKDIR /home/diloco
# The codec's Numba kernels, compiled into NUMBA_CACHE_DIR: a new container loads them instead of
# compiling them (~15 s). A host whose CPU differs from the build machine's compiles them again.
RUN python -c "from shared.codec import api; api.warm_up()"
ENTRYPOINT ["diloco"]
