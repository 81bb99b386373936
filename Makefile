# Elephant: `make run` starts the whole system; `make test` runs every test.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
PORT ?= 8000
PYTEST_ARGS ?=
STAMP := $(VENV)/.installed

.PHONY: install run test lint bench

$(STAMP): requirements.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -r requirements.txt
	touch $(STAMP)

install: $(STAMP)

run: install
	$(BIN)/python manage.py migrate --noinput
	$(BIN)/python manage.py serve_demo --port $(PORT)

# PYTEST_ARGS narrows a run, e.g. `make test PYTEST_ARGS="billing marketplace"`.
test: install
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# The floors (import-linter's contracts in .importlinter) and ruff's lint.
lint: install
	$(BIN)/lint-imports
	$(BIN)/ruff check .

bench: install
	$(BIN)/python bench/request_path.py
