# prfaas-testbed. `make replay` runs the paper comparison; `make test` runs the tests.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
PKG_STAMP := $(VENV)/.installed-packages
RUNS   ?= runs

.PHONY: docs docs-serve docs-check docs-results install profiles replay test test-pure test-app test-netns test-netem test-docker test-slow test-clients test-profiles test-observability test-busy typecheck bench model clean down notebooks linkcheck replay-wan image image-rebuild base-image replay-compose replay-swarm replay-swarm-multi replay-paper replay-cache replay-bandwidth plan replay-sim replay-paper-sim bench-sim crosscheck models replay-longterm plan-refine bench-sim-faults bench-peers crosscheck-dynamo

# The package's bytecode, written ahead: where PYTHONDONTWRITEBYTECODE is set (as on CI runners)
# every service process of a run would otherwise compile the package again, 0.5 s of CPU each.
BYTECODE = $(BIN)/python -m compileall -q testbed

# Packages go into the venv with uv (PyPI's `uv`: the same resolution as pip, about a third of its time
# on a fresh clone, bytecode compiled as pip does), or with pip where uv cannot be installed.
PIP_INSTALL = pipi() { if [ -x $(BIN)/uv ]; then $(BIN)/uv pip install -q --compile-bytecode --python $(BIN)/python "$$@"; \
	else $(BIN)/pip install -q "$$@"; fi; }; pipi

# The compiled twins of core mechanisms (native/, Rust via maturin; testbed.core.native) are built
# where a Rust toolchain is (cargo on PATH or in ~/.cargo/bin) unless NATIVE=0; without them, or where
# the build fails, the pure-Python modules run: the same results, more slowly.
NATIVE ?= 1
CARGO_BIN := $(or $(dir $(shell command -v cargo 2>/dev/null)),$(wildcard $(HOME)/.cargo/bin/))
NATIVE_SRC := native/Cargo.toml native/Cargo.lock native/pyproject.toml native/testbed_native.pyi $(wildcard native/src/*.rs)
BUILD_NATIVE = if [ "$(NATIVE)" = 0 ]; then $(BIN)/python -m pip uninstall -q -y prfaas-testbed-native 2>/dev/null || true; \
	elif [ -z "$(CARGO_BIN)" ]; then echo "note: no Rust toolchain (cargo): the simulator runs its pure-Python mechanisms"; \
	else export PATH="$(CARGO_BIN):$$PATH"; $(PIP_INSTALL) --reinstall ./native || \
	  echo "note: building native/ failed (above): the simulator runs its pure-Python mechanisms"; fi

# The simulator's hot modules (testbed/compiled.py: plain typed Python) compiled to C by mypyc where a C
# compiler is, unless COMPILED=0 (which removes a build). The sources stay what runs without a build,
# with TESTBED_COMPILED=0, or where one has changed since (a stale build is never loaded).
COMPILED ?= 1
HOT_SRC := testbed/compiled.py $(shell sed -n 's/^    "\(testbed\.[a-z_.]*\)",$$/\1/p' testbed/compiled.py | tr . / | sed 's/$$/.py/')
BUILD_COMPILED = if [ "$(COMPILED)" = 0 ]; then $(BIN)/python tools/build_compiled.py --clean; \
	elif ! command -v cc >/dev/null 2>&1; then echo "note: no C compiler (cc): the simulator runs its hot modules as Python"; \
	else $(BIN)/python tools/build_compiled.py || { $(BIN)/python tools/build_compiled.py --clean; \
	  echo "note: compiling the hot modules failed (above): they run as Python"; }; fi

# The compiled twins' lint, where they are built: rustfmt's layout (native/rustfmt.toml) and clippy's
# warnings as errors. Their behaviour is the differential tests' (tests/test_native_*.py).
LINT_NATIVE = if [ "$(NATIVE)" != 0 ] && [ -n "$(CARGO_BIN)" ]; then export PATH="$(CARGO_BIN):$$PATH"; \
	if cargo clippy --version >/dev/null 2>&1; then cd native && cargo fmt --check && cargo clippy -q --locked -- -D warnings && \
	  echo "native/: rustfmt and clippy clean"; \
	else echo "note: no clippy in this Rust toolchain: native/ not linted"; fi; fi

# The Python checks: mypy (strict, on the package), the import contracts (import-linter), ruff's lint
# and its layout (settings in pyproject.toml) over the package, the tests, the docs' scripts and the
# notebooks. Every check runs; each failure is named on its own line and fails the whole.
LINT_DIRS := testbed tests docs analysis
CHECK_PY = bad=""; \
	$(BIN)/mypy || bad="$$bad mypy"; \
	$(BIN)/lint-imports || bad="$$bad lint-imports"; \
	$(BIN)/ruff check $(LINT_DIRS) || bad="$$bad ruff-check"; \
	$(BIN)/ruff format --check $(LINT_DIRS) || bad="$$bad ruff-format"; \
	if [ -n "$$bad" ]; then echo "FAILED:$$bad (ruff: \`$(BIN)/ruff check --fix $(LINT_DIRS)\` and \`$(BIN)/ruff format $(LINT_DIRS)\` fix most)"; false; fi

$(PKG_STAMP): pyproject.toml $(NATIVE_SRC)
	@echo "make install: creating $(VENV) and installing the testbed with its dev, analysis, clients, profiles and routers extras (about 2 minutes on a fresh clone)"
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q uv || $(BIN)/pip install -q --upgrade pip
	@echo "make install: resolving and installing the packages (the slow step)"
	$(PIP_INSTALL) -e '.[dev,analysis,clients,profiles,routers]'
	@echo "make install: building the compiled twins (native/) where a Rust toolchain is"
	@$(BUILD_NATIVE)
	@echo "make install: compiling the package's bytecode"
	$(BYTECODE)
	touch $(PKG_STAMP)

$(STAMP): $(PKG_STAMP) $(HOT_SRC) tools/build_compiled.py
	@echo "make install: compiling the simulator's hot modules (testbed/compiled.py) where a C compiler is"
	@$(BUILD_COMPILED)
	touch $(STAMP)
	@echo "make install: done ($(VENV))"

install: $(STAMP)

## The documentation site (docs/, mkdocs.yml) built in strict mode into build/site: a broken link, a
## missing page or a reference page that cannot be generated fails it. Installs the docs extra.
DOCS_STAMP := $(VENV)/.installed-docs
$(DOCS_STAMP): $(STAMP)
	$(PIP_INSTALL) -e '.[docs]'
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	DISABLE_MKDOCS_2_WARNING=true NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir build/site

## The built site opens from file:// (build/site/index.html, search included); docs-serve serves it over
## HTTP instead, on loopback (DOCS_PORT, default 8000). docs-check opens it in headless Chromium: a
## sidebar link opens its page and search ranks the traces guide first for "mooncake".
DOCS_PORT ?= 8000
docs-serve: docs
	@echo "make docs-serve: http://127.0.0.1:$(DOCS_PORT)/index.html (Ctrl-C stops it)"
	$(BIN)/python -m http.server --bind 127.0.0.1 --directory build/site $(DOCS_PORT)
docs-check: docs
	$(BIN)/python tests/site_browser.py --site build/site

## Rerun the measurements the docs quote (testbed/docsite/measurements.py) into docs/results/data/,
## each stamped with date, commit, host and command. ONLY=name,name selects; SKIP_EMULATION=1 runs
## only the model and simulation ones; RENDER_ONLY=1 rewrites the files from the last run's outputs
## without measuring; `$(BIN)/python -m testbed.docsite.results --list` lists them.
docs-results: $(STAMP)
	$(BIN)/python -m testbed.docsite.results $(if $(ONLY),--only $(ONLY)) $(if $(SKIP_EMULATION),--skip-emulation) \
	  $(if $(RENDER_ONLY),--render-only)

## The main job: the three paper deployments on one seeded workload, one comparison report. Exits
## non-zero (3) when the testbed marks any run invalid (docs/guides/reading-a-run.md).
replay: $(STAMP)
	@$(BYTECODE)
	$(BIN)/testbed replay --compare paper-homogeneous paper-prfaas paper-naive --out $(RUNS)/paper-compare --overwrite

## The same comparison by the discrete-event simulator (seconds, no root): same workload, same run directories.
replay-sim: $(STAMP)
	$(BIN)/testbed replay --compare paper-homogeneous paper-prfaas paper-naive --backend sim --report --out $(RUNS)/paper-compare-sim --overwrite

## Model, simulation and netns emulation of make replay's workload side by side for the three paper
## deployments, each difference against the simulator's tolerances and explained from the records (root).
## CROSSCHECK_ARGS=--check exits 1 when one is outside; --emulated runs/paper-compare reuses make replay's runs.
crosscheck: $(STAMP)
	$(BIN)/testbed crosscheck --scenario paper-homogeneous --scenario paper-prfaas --scenario paper-naive \
	  --backend netns --out $(RUNS)/crosscheck --overwrite $(CROSSCHECK_ARGS)

## The feasibility map: PrfaaS-PD against homogeneous PD for every model profile x link rate
## (1-400 Gbit/s) x RTT (30, 150 ms), by the model and by simulation (no root; minutes).
## Emulated confirmation of three points (root): testbed feasibility --confirm 3 --out $(RUNS)/feasibility --overwrite
models: $(STAMP)
	$(BIN)/testbed feasibility --ttft-slo 30 --out $(RUNS)/feasibility --overwrite

## The measured-kernel model profiles (scenarios/models/aiconfigurator) from aiconfigurator (the profiles extra).
AIC_MODELS := minimax-m2.5 mimo-v2-flash qwen3.5-397b qwen3-235b
profiles: $(STAMP)
	@for m in $(AIC_MODELS); do $(BIN)/testbed profile --aiconfigurator $$m --out scenarios/models/aiconfigurator/$$m.yaml || exit 1; done

## The analytical model of the paper (Table 6).
model: $(STAMP)
	$(BIN)/testbed model --scenario paper-prfaas --scenario paper-homogeneous --scenario paper-naive

## Plan deployments for a trace with the analytical model: threshold, P/D split (and with
## PLAN_ARGS=--vary-counts instance counts) per deployment kind; scenario files and plan.md.
plan: $(STAMP)
	@test -n "$(TRACE)" || { echo "usage: make plan TRACE=path/to/trace.jsonl [PLAN_ARGS='--objective ttft ...']"; exit 2; }
	$(BIN)/testbed plan --trace $(TRACE) --out $(RUNS)/plan-$(basename $(notdir $(TRACE))) --overwrite $(PLAN_ARGS)

## Plans chosen by simulation on two one-hour conversation surrogates that differ only in their
## arrivals (Poisson, and bursts with inter-arrival CV 3): the model's estimate beside the
## simulator's figures for the best 5 of each kind (docs/guides/planning.md; a few minutes).
PLAN_REFINE := $(RUNS)/plan-refine
plan-refine: $(STAMP)
	@mkdir -p $(PLAN_REFINE)
	for cv in 1 3; do \
	  $(BIN)/testbed trace synth --prefix-reuse chat --requests 12000 --rate 3.3333 --seed 1 --arrival-cv $$cv \
	    --out $(PLAN_REFINE)/chat-cv$$cv.jsonl && \
	  $(BIN)/testbed plan --trace $(PLAN_REFINE)/chat-cv$$cv.jsonl --refine 5 --out $(PLAN_REFINE)/cv$$cv --overwrite || exit 1; \
	done

## Every test tier this machine can run (tiers that need root or Docker skip with a reason).
## The type checks, the import contracts, ruff's lint and layout and the Rust lint (CHECK_PY,
## LINT_NATIVE) beside the pure tier (no I/O, no timing), while the container image the docker tier
## needs builds (its log: build/image.log); then the tiers that start services without containers,
## in two lanes side by side: the app tier (its output in build/test-app.log, shown when it ends)
## beside the netns, clients and observability tiers. Those tests wait on timers and sockets most of the time (about a third of two CPUs
## busy, one lane alone), each lane is to the other what `make test-busy`'s one-core hog is, and
## none looks at what is not its own run's (every check of what is left goes by the run's prefix).
## The image may still be building beside their first tests. The docker tier once both lanes and
## the image are done.
test: $(STAMP)
	@mkdir -p build
	@$(BYTECODE)
	@$(NEED_PROMETHEUS)
	@rc=0; \
	$(BIN)/python -m testbed.deploy.image --if-possible > build/image.log 2>&1 & image=$$!; \
	{ $(CHECK_PY) && { $(LINT_NATIVE); }; } > build/typecheck.log 2>&1 & types=$$!; \
	$(BIN)/pytest -q -m "pure and not slow" --durations=5 || rc=1; \
	wait $$types || { rc=1; echo "make test: the static checks failed (build/typecheck.log):"; }; cat build/typecheck.log; \
	$(BIN)/pytest -q -p no:cacheprovider -m "app and not docker and not slow" --durations=15 \
	  > build/test-app.log 2>&1 & app=$$!; \
	$(BIN)/pytest -q -m "not pure and not app and not docker and not slow" --durations=15 || rc=1; \
	wait $$app || rc=1; echo "make test: the app tier (build/test-app.log):"; cat build/test-app.log; \
	wait $$image || echo "make test: the image build failed (build/image.log); the docker tier will say why"; \
	$(BIN)/pytest -q -m "docker and not slow" --durations=15 || rc=1; \
	exit $$rc

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
## The netem tier: this kernel may lack sch_netem (the delay line then stands in), so a user-mode-linux
## guest (a kernel with netem, an ordinary process, no KVM) boots over this machine's filesystem and
## runs the shaping tests, `testbed linkcheck` on every profile and a short netns replay with method
## netem (tests/netem/, log in build/netem/console.log). The kernel is Debian's user-mode-linux where a
## probe boot shows it runs on this CPU; where it panics (the 6.1 and 6.12 UML kernels do on hosts
## whose FPU state they cannot pass on: `ptrace set fp regs failed, errno = 14`), a newer one pinned in
## tests/netem/uml_kernel.py, fetched once from the Debian mirror into build/uml/ (with trixie's glibc
## and patchelf where the host's glibc is older). Installs user-mode-linux and kmod when missing (root,
## apt); skips with the reason where no kernel can be had.
NETEM_PKGS := user-mode-linux kmod
test-netem: $(STAMP)
	@$(BYTECODE)
	@have() { command -v linux.uml >/dev/null && command -v insmod >/dev/null; }; \
	if ! have && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "make test-netem: installing $(NETEM_PKGS)"; \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(NETEM_PKGS) >/dev/null 2>&1 || \
	  { apt-get update -qq >/dev/null 2>&1; DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(NETEM_PKGS) >/dev/null 2>&1; } || true; \
	fi; \
	if ! have; then \
	  echo "make test-netem: skipped: no linux.uml/insmod and they cannot be installed here (needs root and apt with Debian's $(NETEM_PKGS))"; \
	  exit 0; \
	fi; \
	rc=0; PYTHON=$(abspath $(BIN))/python tests/netem/run_uml.sh || rc=$$?; \
	if [ $$rc = 77 ]; then echo "make test-netem: skipped (the reason above)"; rc=0; fi; exit $$rc
## aiperf and the openai package against `testbed up --hold` (part of `make test` too).
test-clients: $(STAMP)
	$(BIN)/pytest -q -m clients
## Profiles written from aiconfigurator against direct calls (part of `make test` too; skipped without the extra).
test-profiles: $(STAMP)
	$(BIN)/pytest -q -m profiles
## The real Prometheus against a held deployment (part of `make test` too). Debian's `prometheus`
## is installed when missing (root, apt; without its recommended node exporter); where it cannot
## be had, the tier skips with the reason.
NEED_PROMETHEUS = command -v prometheus >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	{ echo "make: installing Debian's prometheus for the observability tier"; \
	  apt() { DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null 2>&1; }; \
	  apt || { apt-get update -qq >/dev/null 2>&1; apt; }; }; } || echo "make: no prometheus binary: the observability tier skips"
test-observability: $(STAMP)
	@$(NEED_PROMETHEUS)
	$(BIN)/pytest -q -m observability
## The timing-sensitive tiers (app, netns, docker) beside a one-core CPU hog, as on a shared CI
## runner: `stress-ng --cpu 1` (Debian's stress-ng, installed when missing, as root).
NEED_STRESS = command -v stress-ng >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	{ echo "make: installing Debian's stress-ng"; \
	  apt() { DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends stress-ng >/dev/null 2>&1; }; \
	  apt || { apt-get update -qq >/dev/null 2>&1; apt; }; }; }
test-busy: $(STAMP)
	@$(BYTECODE)
	@$(NEED_STRESS) || { echo "make test-busy: needs stress-ng (apt-get install stress-ng)"; exit 2; }
	@stress-ng --cpu 1 --quiet & hog=$$!; trap 'kill $$hog 2>/dev/null' EXIT INT TERM; \
	$(BIN)/pytest -q -m "(app or netns or docker) and not slow" --durations=10

typecheck: $(STAMP)
	@$(CHECK_PY)
	@$(LINT_NATIVE)

## Benchmarks print figures; they are not pass/fail tests.
bench: $(STAMP)
	$(BIN)/testbed bench fidelity --scenario paper-prfaas

## The simulator's speed (a one-hour Mooncake-format trace) and scale (10,000 GPUs, 15 minutes).
bench-sim: $(STAMP)
	$(BIN)/testbed bench sim --out $(RUNS)/bench-sim --overwrite

## The 10,000-GPU deployment through a 60 s WAN outage and a decode rack's loss, with and
## without the short-term bandwidth loop (simulator).
bench-sim-faults: $(STAMP)
	$(BIN)/testbed bench sim-faults --out $(RUNS)/bench-sim-faults --overwrite

## NVIDIA Dynamo's mocker, the `peer` extra (ai-dynamo-runtime), installed on first use.
PEER_STAMP := $(VENV)/.installed-peer
$(PEER_STAMP): $(STAMP)
	$(PIP_INSTALL) -e '.[peer]'
	touch $(PEER_STAMP)

## The whole job against Dynamo's mocker: `replay --backend sim` (run directory included) and the mocker's offline
## replay on the same Mooncake-format trace (the one-hour conversation surrogate, PEER_TRACE=path for your own) and
## worker counts (8P/4D; 80P/40D at 10x the rate), each run its own process pinned to one CPU, interleaved: median
## whole-process and simulation times, peak RSS, the ratios against the bars. BENCH_PEERS_ARGS=--repeats 5 ...
bench-peers: $(PEER_STAMP)
	$(BIN)/testbed bench peers --out $(RUNS)/bench-peers --overwrite $(if $(PEER_TRACE),--trace $(PEER_TRACE)) $(BENCH_PEERS_ARGS)

## The simulator beside Dynamo's mocker on the one-hour surrogate at 8P/4D, the same timing tables: TTFT, ITL,
## throughput and cache hits side by side, each difference above 5% explained (PEER_TRACE=path for your own).
PEER_DEFAULT_TRACE := $(RUNS)/mooncake-chat-1h.jsonl
crosscheck-dynamo: $(PEER_STAMP)
	@mkdir -p $(RUNS)
	@test -n "$(PEER_TRACE)" || test -f $(PEER_DEFAULT_TRACE) || \
	  $(BIN)/testbed trace synth --format mooncake --prefix-reuse chat --requests 12000 --rate 3.3333 --seed 1 --out $(PEER_DEFAULT_TRACE)
	$(BIN)/testbed crosscheck --peer dynamo --scenario paper-homogeneous --set clusters.0.prefill=8 \
	  --set clusters.0.decode=4 --trace $(or $(PEER_TRACE),$(PEER_DEFAULT_TRACE)) --out $(RUNS)/crosscheck-dynamo --overwrite $(CROSSCHECK_ARGS)

## Measure what a shaped link delivers against its profile (root).
linkcheck: $(STAMP)
	$(BIN)/testbed linkcheck cross-region-100g
	$(BIN)/testbed linkcheck cross-region-100g-lossy
	$(BIN)/testbed linkcheck cross-region-100g-halving

## WAN usage near capacity: hybrid vs dense KV over a 100 Gbit/s cross-region link (root, netns).
WAN_SET := --backend netns --rate 3.0 --requests 800 --set scale.speedup=2 --set scale.byte_scale=200
replay-wan: $(STAMP)
	$(BIN)/testbed replay --compare paper-prfaas paper-prfaas-dense $(WAN_SET) --out $(RUNS)/wan-hybrid-vs-dense --overwrite

## The paper's Table 6 by emulation: Lambda_max of the three deployments by bisection over
## offered rates on the 100 Gbit/s cross-region link, TTFT at a common load, the model beside it.
PAPER_TABLE := --probes 6 --requests 300 --ttft-slo 30 --wait-growth 2.5 --set workload.seed=45
replay-paper: $(STAMP)
	$(BIN)/testbed capacity --scenario paper-homogeneous --scenario paper-prfaas --scenario paper-naive \
	  $(PAPER_TABLE) --out $(RUNS)/paper-table --overwrite

## Table 6 by simulation: the same capacity search as replay-paper, every probe simulated (under a minute).
replay-paper-sim: $(STAMP)
	$(BIN)/testbed capacity --scenario paper-homogeneous --scenario paper-prfaas --scenario paper-naive \
	  $(PAPER_TABLE) --backend sim --out $(RUNS)/paper-table-sim --overwrite

## Cache-aware against length-only PrfaaS routing on a Mooncake-format trace with prefix reuse
## (long-context agent sessions) over the measured 14.7 Gbit/s cross-cloud link.
CACHE_SET := --trace traces/samples/mooncake-agent-sample.jsonl --set links.inter_dc=cross-region-15g-measured
replay-cache: $(STAMP)
	$(BIN)/testbed replay --compare paper-prfaas paper-prfaas-cache $(CACHE_SET) --out $(RUNS)/cache-aware --overwrite

## Load-aware cache routing against length-only and the paper's cache rules, simulated, on the
## first 10 minutes of a one-hour Mooncake-format surrogate of the conversation trace.
LOAD_TRACE := $(RUNS)/mooncake-chat-1h.jsonl
replay-load-aware: $(STAMP)
	mkdir -p $(RUNS)
	$(BIN)/testbed trace synth --prefix-reuse chat --requests 12000 --rate 3.3333 --seed 1 --out $(LOAD_TRACE)
	$(BIN)/testbed replay --compare paper-prfaas paper-prfaas-cache paper-prfaas-load-aware --backend sim --report \
	  --trace $(LOAD_TRACE) --window :10m --out $(RUNS)/load-aware --overwrite

## Bandwidth-aware against fixed-threshold PrfaaS while the WAN drops to 10% for a minute,
## then to half, then recovers (cross-region-100g-fluctuating).
BW_SET := --set links.inter_dc=cross-region-100g-fluctuating --rate 2.2 --requests 400 --set workload.seed=45
replay-bandwidth: $(STAMP)
	$(BIN)/testbed replay --compare paper-prfaas paper-prfaas-bw $(BW_SET) --out $(RUNS)/bandwidth-aware --overwrite

## The long-term loop (simulator, seconds): the first 10 minutes of a one-hour Mooncake-format
## conversation trace at its own rate (~3.3 req/s) on the paper's static configuration, on the
## same with both loops on (paper-prfaas-adaptive), and on what `testbed plan` makes of the trace.
LT_DIR := $(RUNS)/longterm
replay-longterm: $(STAMP)
	$(BIN)/testbed trace synth --format mooncake --prefix-reuse chat --requests 12000 --rate 3.3333 --seed 1 --out $(LT_DIR)/chat-1h.jsonl
	$(BIN)/testbed plan --trace $(LT_DIR)/chat-1h.jsonl --window 0:600 --kinds prfaas --out $(LT_DIR)/plan --overwrite
	$(BIN)/testbed replay --compare paper-prfaas paper-prfaas-adaptive $(LT_DIR)/plan/plan-prfaas-1.yaml --trace $(LT_DIR)/chat-1h.jsonl --window 0:600 --backend sim --report --out $(LT_DIR)/compare --overwrite

## The container image for the compose backend: built offline, only when missing or stale.
image: $(STAMP)
	$(BIN)/python -m testbed.deploy.image
image-rebuild: $(STAMP)
	$(BIN)/python -m testbed.deploy.image --rebuild
base-image:
	compose/bootstrap-base.sh

## A short paper-prfaas replay on the compose backend over the shaped cross-region link
## (builds the image first when needed; one container per instance plus router and WAN router).
replay-compose: $(STAMP)
	$(BIN)/testbed up --backend compose --scenario paper-prfaas --requests 120 --rate 1.6 --out $(RUNS)/compose-prfaas --overwrite

## The same as a Docker Swarm stack (on a swarm manager, as root; nodes labelled per datacenter,
## see compose/README.md; a single-node swarm gets every label on its only node).
replay-swarm: $(STAMP)
	$(BIN)/testbed up --backend swarm --scenario paper-prfaas --requests 120 --rate 1.6 --out $(RUNS)/swarm-prfaas --overwrite

## The same on a swarm of three Docker engines on this machine (Docker-in-Docker nodes, one per
## datacenter and one for the WAN router; testbed/deploy/swarm_lab.py): the lab up, the replay on
## its manager, the lab removed (also on Ctrl-C). Root; the node image builds once (~20 s).
replay-swarm-multi: $(STAMP)
	$(BIN)/python -m testbed.deploy.swarm_lab run --scenario paper-prfaas -- --requests 120 --rate 1.6 \
	  --out $(RUNS)/swarm-multi-prfaas --overwrite

## Remove every namespace, process and container a killed run left behind (idempotent).
down: $(STAMP)
	$(BIN)/testbed down

clean:
	rm -rf $(VENV) build *.egg-info .mypy_cache .pytest_cache compose/wheels testbed/_compiled.stamp
	find testbed -name '*.so' -delete

## Analysis notebooks (analysis/*.ipynb) executed headless to $(RUNS)/notebooks-html; fails if a cell errors.
## Inputs: $(RUNS)/paper-compare when `make replay` made it, else a tiny comparison; a tiny threshold sweep;
## $(RUNS)/feasibility when `make models` made it, else a small model-only map.
NB_FAST    := --backend inproc --set scale.speedup=40 --set workload.output_tokens=16 --set serving.stream_interval=4 --requests 12
NB_COMPARE  = $(if $(wildcard $(RUNS)/paper-compare/comparison.md),$(RUNS)/paper-compare,$(RUNS)/notebook-compare)
NB_MAP      = $(if $(wildcard $(RUNS)/feasibility/map.csv),$(RUNS)/feasibility,$(RUNS)/notebook-feasibility)

notebooks: $(STAMP)
	@test -f $(NB_COMPARE)/comparison.md || $(BIN)/testbed replay --compare paper-homogeneous paper-prfaas paper-naive \
	  $(NB_FAST) --accept-invalid --out $(RUNS)/notebook-compare --overwrite
	@test -f $(RUNS)/notebook-sweep/sweep.csv || $(BIN)/testbed sweep --scenario paper-prfaas \
	  --param policy.threshold=10000,19400,40000 $(NB_FAST) --out $(RUNS)/notebook-sweep --overwrite
	@test -f $(NB_MAP)/map.csv || $(BIN)/testbed feasibility --sim none --no-break-even --rates 10,100,400 \
	  --out $(RUNS)/notebook-feasibility --overwrite
	RUNS_DIR=$(abspath $(NB_COMPARE)) RUN_DIR=$(abspath $(NB_COMPARE))/paper-prfaas SWEEP_DIR=$(abspath $(RUNS))/notebook-sweep \
	  MAP_DIR=$(abspath $(NB_MAP)) \
	  $(BIN)/jupyter nbconvert --execute --to html --ExecutePreprocessor.timeout=600 \
	  --output-dir $(RUNS)/notebooks-html analysis/*.ipynb
