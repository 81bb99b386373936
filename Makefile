# Elephant: `make run` starts the whole system; `make test` runs every test.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
PORT ?= 8000
PYTEST_ARGS ?=
STAMP := $(VENV)/.installed

.PHONY: install run test lint bench mahout-wheel

$(STAMP): requirements.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@echo "Installing into $(VENV). The first time, pip compiles llama-cpp-python from source: about 5 minutes on 2 cores, shown as 'Building wheel for llama-cpp-python'; later installs reuse the wheel."
	$(BIN)/pip install --disable-pip-version-check --progress-bar on -r requirements.txt 2>&1 | grep -v -E "^(WARNING: Location|Requirement already satisfied)" ; test $${PIPESTATUS[0]} -eq 0
	touch $(STAMP)

install: $(STAMP)

run: install
	$(BIN)/python manage.py migrate --noinput
	$(BIN)/python manage.py serve_demo --port $(PORT)

# PYTEST_ARGS narrows a run, e.g. `make test PYTEST_ARGS="billing marketplace"`.
test: install
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# The floors (import-linter's contracts in .importlinter), ruff's lint and mypy's types (tests aside).
lint: install
	$(BIN)/lint-imports
	$(BIN)/ruff check .
	$(BIN)/mypy accounts catalog core hosts billing mesh web config engine mahout protocol marketplace testkit scorer --exclude /tests/

# The documentation site: docs/ (mkdocs.yml) built strictly into site/; a broken link fails it.
.PHONY: docs
docs: install
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

bench: install
	$(BIN)/python bench/request_path.py

# The host client alone, for GPU owners: dist/elephant_mahout-<version>-py3-none-any.whl
# (`pip install` it into any Python 3.11+ environment; `[ring]` adds the engine's torch).
mahout-wheel: install
	$(BIN)/pip wheel --no-deps --no-build-isolation --disable-pip-version-check -w dist . 2>&1 | grep -v "^WARNING: Location"
	rm -rf build elephant_mahout.egg-info
	@ls dist/elephant_mahout-*.whl
