# One entry point for every routine task. The README's Quick start uses `make run` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install run test test-fast lint format clean bench browser

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)  ## create .venv and install the project with its test tools

run: $(STAMP)  ## train with a local cluster: 4 learners on the small model, then print the summary
	$(BIN)/diloco up $(ARGS)

test: $(STAMP) browser  ## the whole test suite (unit, integration and slow tiers)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

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

test-fast: $(STAMP)  ## unit tests only
	$(BIN)/python -m pytest -m "not slow" $(PYTEST_ARGS)

bench: $(STAMP)  ## the benchmarks that write BENCHMARKS.md (~1 h on 2 cores in all)
	$(BIN)/python -m pip install --quiet -e '.[bench]'
	$(BIN)/python bench/codec.py --write
	$(BIN)/python bench/codec_parts.py --write
	$(BIN)/python bench/quality.py --write
	$(BIN)/python bench/quality.py --codecs --write
	$(BIN)/python bench/throughput.py --write
	$(BIN)/python bench/chaos.py --minutes 5 --write

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

clean:
	rm -rf data .pytest_cache .ruff_cache
