# One image for every service: `diloco learner|outer|gateway` and the bundled nats-server.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    DILOCO_JAX_CACHE=/cache/jax NUMBA_CACHE_DIR=/opt/diloco/numba-cache
WORKDIR /app
# The dependencies, exactly as locked (with their hashes), in a layer of their own: it is
# rebuilt only when requirements.lock changes, not on every source edit.
COPY requirements.lock /src/
RUN pip install -r /src/requirements.lock
COPY pyproject.toml README.md /src/
COPY shared /src/shared
COPY services /src/services
# The project itself, nothing resolved again; the source copy is then removed, so that every
# process imports the installed package. Then the codec's Numba kernels are compiled into
# NUMBA_CACHE_DIR, so a new container loads them instead of compiling them (~15 s); a host
# whose CPU differs from the build machine's compiles them once more.
RUN pip install --no-deps /src && rm -rf /src \
    && python -c "from shared import codec; codec.warm_up()" \
    && mkdir -p /cache/jax /data
ENTRYPOINT ["diloco"]
