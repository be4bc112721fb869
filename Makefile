# The two commands of the README:  make chat  |  make test
# Each sets up everything it needs: a virtual environment in .venv, and on Linux an
# OpenBLAS preloaded under MLX's CPU matmuls, so they batch like a real accelerator:
# numpy's own, through a shim built here (edgespec/kernels/cpu_blas.py), or where that
# cannot be built, Debian's.

VENV      ?= .venv
PY        := $(VENV)/bin/python
PIP       := $(PY) -m pip install -q --disable-pip-version-check
UNAME     := $(shell uname -s)
OPENBLAS  := /usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0
CBLAS     := .cache/lib/libedgespec_cblas.so
ifeq ($(UNAME),Linux)
  EXTRAS  := cpu,dev
  # PyPI's Linux torch is the CUDA build; the CPU build where this machine's pip finds one.
  TORCH    = $(PIP) "torch==2.13.0+cpu" || $(PIP) torch
  # Decided by the shell when a recipe runs (after setup built it or not; make's own
  # file cache could miss a file a sub-make wrote): the shim if built, else Debian's.
  PRELOAD  = $$(test -f $(abspath $(CBLAS)) && echo $(abspath $(CBLAS)) || echo $(OPENBLAS))
  RUNENV   = LD_PRELOAD=$(PRELOAD)
else
  EXTRAS  := dev
  TORCH    = $(PIP) torch
  PRELOAD  =
  RUNENV   =
endif
PYTEST_ARGS ?=
# Test processes (pytest-xdist); each test file runs whole in one of them, so module and session
# fixtures (the default model, loaded once per process) are shared by its tests. 1: one process.
TEST_WORKERS ?= 2
# The Swift package (apps/swift, EdgespecKit) is built and tested after pytest when a
# Swift toolchain is found: `swift` on PATH, else /opt/swift. Without one it is skipped.
SWIFT     ?= $(shell command -v swift 2>/dev/null || { test -x /opt/swift/usr/bin/swift && echo /opt/swift/usr/bin/swift; })
SWIFT_FIXTURE := .cache/swift-test
# The servers those tests start keep what they write (learnt costs, verified checksums) in a
# home of their own, emptied each run: never in the user's ~/.cache/edgespec.
SWIFT_HOME    := $(SWIFT_FIXTURE)/home
# A hung Swift test ends the run after 15 minutes instead of holding CI (they take ~10 s).
SWIFT_TIMEOUT := $(shell command -v timeout >/dev/null 2>&1 && echo timeout 900)

.PHONY: chat test swift-test setup openblas preload clean

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check --upgrade pip
	# torch first, only for the Hugging Face reference tests: the CPU build where the
	# machine offers one (2.13.0+cpu), so that the dev extras (accelerate) find it
	# installed and do not pull the CUDA build and its NVIDIA libraries (3 GB unused).
	$(TORCH)
	$(PY) -m pip install -q --disable-pip-version-check -e ".[$(EXTRAS)]"
	# The published DFlash reference the DFlash tests compare with (tests/test_dflash.py): its
	# model code needs only torch and transformers; its own pins (datasets, tqdm) are not wanted.
	$(PY) -m pip install -q --disable-pip-version-check --no-deps "dflash==0.1.0"
	# The `speculators` package's EAGLE-3 model code, the reference of tests/test_eagle3.py: it
	# computes with torch and transformers; its training, data and serving pins are not wanted.
	$(PY) -m pip install -q --disable-pip-version-check --no-deps "speculators==0.9.0"
	touch $@

# MLX's CPU products on numpy's OpenBLAS (one OpenBLAS in the process, its few-row
# kernels); built and checked in a fresh process, written atomically. A failure is
# reported and leaves Debian's OpenBLAS as the fallback below.
$(CBLAS): $(VENV)/.installed edgespec/kernels/cblas_forward.c edgespec/kernels/cblas_skinny.h edgespec/kernels/cpu_blas.py
	-$(PY) -m edgespec.kernels.cpu_blas $@

openblas:
ifeq ($(UNAME),Linux)
	@$(MAKE) --no-print-directory $(CBLAS)
	@test -f $(CBLAS) || test -f $(OPENBLAS) || { (apt-get update -qq && apt-get install -y -qq libopenblas0-pthread) >/dev/null 2>&1 \
	  || sudo sh -c 'apt-get update -qq && apt-get install -y -qq libopenblas0-pthread' >/dev/null 2>&1; }
	@test -f $(CBLAS) || test -f $(OPENBLAS) || echo "warning: no OpenBLAS (shim not built, libopenblas0-pthread not installed); MLX falls back to its slow reference BLAS"
endif

# What to preload for commands run by hand (benchmarks): LD_PRELOAD=$$(make -s preload)
preload:
	@echo $(PRELOAD)

setup: $(VENV)/.installed openblas

chat: setup
	$(RUNENV) $(VENV)/bin/edgespec chat

test: setup
	$(RUNENV) $(PY) -m pytest $(if $(filter-out 1,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile) $(PYTEST_ARGS)
	@$(MAKE) --no-print-directory swift-test

# The Swift tests start real `edgespec serve` processes on a tiny random bundle, and
# compare with the Python API's replies, both written by tests/swift_fixture.py.
# Steps: the fixture, then `swift build` and `swift test` in apps/swift.
swift-test: setup
ifeq ($(strip $(SWIFT)),)
	@echo "swift-test: SKIPPED: no Swift toolchain (no swift on PATH, no /opt/swift/usr/bin/swift); EdgespecKit not built or tested"
else
	rm -rf $(SWIFT_HOME) && mkdir -p $(SWIFT_HOME)
	EDGESPEC_HOME=$(abspath $(SWIFT_HOME)) $(RUNENV) $(PY) tests/swift_fixture.py $(SWIFT_FIXTURE)
	cd apps/swift && $(SWIFT) build
	cd apps/swift && EDGESPEC_HOME=$(abspath $(SWIFT_HOME)) EDGESPEC_TEST_PYTHON=$(abspath $(PY)) EDGESPEC_TEST_FIXTURE=$(abspath $(SWIFT_FIXTURE)) \
	  EDGESPEC_TEST_PRELOAD="$(PRELOAD)" $(SWIFT_TIMEOUT) $(SWIFT) test
endif

clean:
	rm -rf $(VENV) .cache .pytest_cache apps/swift/.build
