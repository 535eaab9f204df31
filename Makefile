# One entry point for every routine task. The README's Quick start uses `make run` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Every runtime and `dev` package, pinned with its PyPI hashes; `make lock` writes it.
LOCK := requirements.lock
# The runtime packages alone, at the same pins and with the same hashes: what the image installs.
RUNTIME_LOCK := requirements-runtime.lock

.PHONY: install lock run test test-fast compose-test lint format clean bench bench-quick browser

# The venv gets exactly the lock file's versions, then the project itself without resolving
# its dependencies again. Editing pyproject.toml or the lock file reinstalls.
$(STAMP): pyproject.toml $(LOCK)
	@command -v $(PYTHON) >/dev/null 2>&1 || { \
		echo "error: '$(PYTHON)' not found. Install Python 3.11 or newer (Debian/Ubuntu:" \
			"apt-get install python3 python3-venv) or name one: make PYTHON=python3.11 ..." >&2; \
		exit 1; }
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || { \
		echo "error: '$(PYTHON)' is not Python 3.11 or newer, which this project needs;" \
			"name one: make PYTHON=python3.11 ..." >&2; \
		exit 1; }
	@$(PYTHON) -m venv $(VENV) || { \
		echo "error: '$(PYTHON) -m venv' failed. On Debian/Ubuntu the venv module is a separate" \
			"package: apt-get install python3-venv (or python3.11-venv), then run make again." >&2; \
		exit 1; }
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -r $(LOCK)
	$(BIN)/python -m pip install --quiet --no-deps -e .
	touch $(STAMP)

install: $(STAMP)  ## create .venv and install the project with its test tools

# The exact commands that wrote $(LOCK) and $(RUNTIME_LOCK): every platform, CPython 3.11 and
# newer (--universal). $(LOCK) has the `dev` extra, `bench` not; $(RUNTIME_LOCK) is resolved
# without extras under $(LOCK) as its constraints, so it pins each package it has exactly as
# $(LOCK) does. Run it after editing the dependencies in pyproject.toml. Pins already in the lock
# are kept where pyproject.toml allows them; `make lock LOCK_ARGS=--upgrade` moves every package
# to its newest allowed release, `make lock LOCK_ARGS="--upgrade-package numba"` one package.
# uv lives in its own venv.
UV_VERSION := 0.13.9
LOCK_TOOLS := $(VENV)/lock-tools
UV_COMPILE := $(LOCK_TOOLS)/bin/uv pip compile pyproject.toml --universal --python-version 3.11 \
	--generate-hashes --custom-compile-command 'make lock'
lock:  ## regenerate requirements.lock and requirements-runtime.lock from pyproject.toml
	test -x $(LOCK_TOOLS)/bin/python || $(PYTHON) -m venv $(LOCK_TOOLS)
	$(LOCK_TOOLS)/bin/python -m pip install --quiet uv==$(UV_VERSION)
	$(UV_COMPILE) --extra dev --output-file $(LOCK) $(LOCK_ARGS)
	$(UV_COMPILE) --constraint $(LOCK) --output-file $(RUNTIME_LOCK)

run: $(STAMP)  ## train with a local cluster: 4 learners on the small model, then print the summary
	$(BIN)/diloco up $(ARGS)

# Test processes that run at once (pytest-xdist). Each integration test starts nats-server and
# JAX processes of its own (about 0.6 GB each), so more workers need more memory, not only cores.
PYTEST_WORKERS ?= 2

# --maxschedchunk 1: each worker is handed a test or two at a time, so the slow tier (run first,
# tests/conftest.py) is shared out as workers come free; by default each would get a quarter of
# its share at once, in a row, and the first worker the whole slow tier.
test: $(STAMP) browser  ## the whole test suite (unit, integration and slow tiers)
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) --maxschedchunk 1 $(PYTEST_ARGS)

# Headless Chromium for the dashboard's browser test (tests/test_observability_e2e.py). Installed
# with apt-get only when missing and apt-get exists; if that fails (no root, no network) the
# browser test is skipped with the reason, and the rest of the suite still runs.
browser:  ## install chromium + chromium-driver (Debian/Ubuntu) unless present
	@if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then \
		:; \
	elif command -v apt-get >/dev/null 2>&1; then \
		echo "installing chromium + chromium-driver for the dashboard's browser test"; \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
			chromium chromium-driver >/dev/null; } \
		|| echo "WARNING: chromium not installed; the browser test will be skipped"; \
	else \
		echo "WARNING: no chromium and no apt-get; the browser test will be skipped"; \
	fi

# docker-compose.yml for real (tests/test_compose.py): sets up what is missing — Debian's
# docker.io and a dockerd (stopped again afterwards), the compose plugin, a base image — then
# builds the image, trains a REST job in containers and tears everything down. `make test` runs
# the same tests only where an engine already answers.
compose-test: $(STAMP)  ## build the image and test the docker-compose cluster end to end
	bash docker/compose-test.sh

test-fast: $(STAMP)  ## unit tests only
	$(BIN)/python -m pytest -m "not slow and not nats" $(PYTEST_ARGS)

# matplotlib (the `bench` extra) is not in the lock file; pip adds it to the locked venv.
# Each benchmark stores its raw results in bench/results/, writes its BENCHMARKS.md section from
# them and exits 1 when one of its claims fails; bench/summary.py adds the stored run times.
bench: $(STAMP)  ## every benchmark on the shipped defaults (hours on 2 cores: BENCHMARKS.md)
	$(BIN)/python -m pip install --quiet -e '.[bench]'
	$(BIN)/python bench/codec.py --write
	$(BIN)/python bench/codec_parts.py --write
	$(BIN)/python bench/throughput.py --write
	$(BIN)/python bench/timing.py --write
	$(BIN)/python bench/chaos.py --write
	$(BIN)/python bench/loadtest.py --write
	$(BIN)/python bench/outer_shards.py --write
	$(BIN)/python bench/links.py --write
	$(BIN)/python bench/goodput.py --write
	$(BIN)/python bench/robust.py --write
	$(BIN)/python bench/quality.py --write
	$(BIN)/python bench/scaling.py --write
	$(BIN)/python bench/summary.py --write

# The smoke version of every benchmark (<= 15 min on 2 cores): the same code at a small scale,
# results in a temporary folder, BENCHMARKS.md untouched; fails when a script fails or leaves
# a claim unmeasured. quality.py reads the goodput.py runs of the same folder.
bench-quick: $(STAMP)  ## a smoke run of every benchmark (<= 15 min), writing nothing here
	export BENCH_QUICK_DIR=$$(mktemp -d) && all=$$(date +%s) && \
	for script in codec codec_parts throughput timing chaos loadtest outer_shards links goodput robust quality scaling; do \
		started=$$(date +%s); \
		$(BIN)/python bench/$$script.py --quick > $$BENCH_QUICK_DIR/$$script.md || { \
			echo "bench-quick: $$script failed (its output: $$BENCH_QUICK_DIR/$$script.md)" >&2; \
			exit 1; }; \
		echo "bench-quick: $$script passed in $$(($$(date +%s) - started)) s"; \
	done && echo "bench-quick: every benchmark passed in $$(($$(date +%s) - all)) s"

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

clean:
	rm -rf data .pytest_cache .ruff_cache
