# prfaas-testbed. `make replay` runs the paper comparison; `make test` runs the tests.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
RUNS   ?= runs

.PHONY: install replay test test-pure test-app test-netns test-docker test-slow typecheck bench model clean down

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

## The main job: the three paper deployments on one seeded workload, one comparison report.
replay: $(STAMP)
	$(BIN)/testbed replay --compare paper-homogeneous paper-prfaas paper-naive --out $(RUNS)/paper-compare

## The analytical model of the paper (Table 6).
model: $(STAMP)
	$(BIN)/testbed model --scenario paper-prfaas --scenario paper-homogeneous --scenario paper-naive

## Every test tier this machine can run (tiers that need root or Docker skip with a reason).
test: $(STAMP)
	$(BIN)/mypy
	$(BIN)/pytest -q -m "not slow"

test-pure: $(STAMP)
	$(BIN)/pytest -q -m pure
test-app: $(STAMP)
	$(BIN)/pytest -q -m app
test-netns: $(STAMP)
	$(BIN)/pytest -q -m netns
test-docker: $(STAMP)
	$(BIN)/pytest -q -m docker
test-slow: $(STAMP)
	$(BIN)/pytest -q -m slow
typecheck: $(STAMP)
	$(BIN)/mypy

## Benchmarks print figures; they are not pass/fail tests.
bench: $(STAMP)
	$(BIN)/testbed bench fidelity --scenario paper-prfaas

clean:
	rm -rf $(VENV) build *.egg-info .mypy_cache .pytest_cache
