# gpuferry — the two commands (`make demo`, `make test`) and the local stacks.
SHELL := /bin/bash
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
UV_VERSION := 0.13.8
# Heavy, machine-wide caches live outside the repo.
export GPUFERRY_CACHE ?= $(HOME)/.cache/gpuferry
# Where pip/uv may find prebuilt wheels on this machine (the CPU build of torch).
FIND_LINKS := $(if $(wildcard /opt/wheels),--find-links /opt/wheels,)


venv: $(VENV)/.installed

$(VENV)/.installed: requirements.lock pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check uv==$(UV_VERSION)
	$(BIN)/uv pip sync --python $(BIN)/python $(FIND_LINKS) requirements.lock
	$(BIN)/uv pip install --python $(BIN)/python --no-deps -e .
	touch $@

# Re-resolve the lock after changing dependencies in pyproject.toml.
lock: venv
	$(BIN)/uv pip compile pyproject.toml --extra workload --extra test --python-version 3.11 \
	  $(FIND_LINKS) -c lock-constraints.txt -o requirements.lock

# ---- the embedded demo ---------------------------------------------------------------------
# State of the embedded backends (MLflow store, checkpoints, job dirs, the local server).
export GPUFERRY_HOME ?= $(CURDIR)/.gpuferry
DEMO_ENV := PREFECT_HOME=$(GPUFERRY_HOME)/prefect PREFECT_SERVER_ANALYTICS_ENABLED=false
# The workload `make demo` runs: any directory with a gpuferry.yaml (make demo DEMO_WORKLOAD=examples/diabetes).
DEMO_WORKLOAD ?= examples/digits

demo: venv
	@mkdir -p $(GPUFERRY_HOME)/prefect
	$(DEMO_ENV) $(BIN)/python -m flows.demo $(DEMO_WORKLOAD)

demo-stop: venv
	$(DEMO_ENV) $(BIN)/python -m flows.demo stop $(DEMO_WORKLOAD)

# ---- local stacks ------------------------------------------------------------------------------
# `make <stack>-up` / `make <stack>-down`: scripts/<stack>.sh up|down. Idempotent; `down` stops only
# what `up` started. Each `up` writes its connection settings to $(GPUFERRY_STACKS)/<stack>/env.
# Order matters: the k8s node reaches the registry stack (to pull the workload image) only when that
# stack is up before it.
STACKS := slurm registry k8s s3 mlflow prefect
.PHONY: venv demo demo-stop test test-fast lint docs bench-overhead lock clean stacks-up stacks-down \
  $(addsuffix -up,$(STACKS)) $(addsuffix -down,$(STACKS))
export GPUFERRY_STACKS ?= $(GPUFERRY_CACHE)/stacks
# The stacks `make test` starts (those whose scripts exist).
TEST_STACKS := $(foreach s,$(STACKS),$(if $(wildcard scripts/$(s).sh),$(s)))

$(addsuffix -up,$(STACKS)): %-up: venv
	@test -f scripts/$*.sh || { echo "the $* stack is not part of this version yet"; exit 1; }
	bash scripts/$*.sh up

$(addsuffix -down,$(STACKS)): %-down:
	@test -f scripts/$*.sh || { echo "the $* stack is not part of this version yet"; exit 1; }
	bash scripts/$*.sh down

stacks-up: $(addsuffix -up,$(TEST_STACKS))
stacks-down: $(addsuffix -down,$(TEST_STACKS))

# ---- tests -----------------------------------------------------------------------------------
PYTEST := PREFECT_SERVER_ANALYTICS_ENABLED=false $(BIN)/python -m pytest -p no:cacheprovider --durations=30

# The house's checks (pyproject.toml configures each): ruff's formatter and linter, mypy, the import contracts
# (import-linter), no import circle but a block and its own check (scripts/import_graph.py), and the docs site
# built strictly (mkdocs.yml: a broken link or a page left out of the nav fails).
lint: venv
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/lint-imports
	$(BIN)/python scripts/import_graph.py > /dev/null || $(BIN)/python scripts/import_graph.py
	site=$$(mktemp -d) && NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet --site-dir $$site; \
	  status=$$?; rm -rf $$site; exit $$status

# Everything: the house's checks, unit tests, the embedded pipeline and the integration tests against the local
# stacks (which it starts; an integration test whose stack is down fails instead of skipping).
test: venv lint stacks-up
	GPUFERRY_REQUIRE_STACKS=1 $(PYTEST) tests

# The house's checks, unit tests and the embedded pipeline only: no outside servers.
test-fast: venv lint
	$(PYTEST) -m "not integration" tests

# The docs site into site/ (docs/reference/ is generated: `python scripts/docs_reference.py` after changing the code
# it describes; tests/test_docs.py says when it is due).
docs: venv
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

bench-overhead: venv
	$(BIN)/python bench/pipeline_overhead.py

clean:
	rm -rf $(VENV) .gpuferry
