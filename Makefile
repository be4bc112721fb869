# The two commands of the README:  make chat  |  make test
# Each sets up everything it needs (a virtual environment in .venv, and on Linux
# Debian's OpenBLAS, preloaded so MLX's CPU matmuls batch like a real accelerator).

VENV      ?= .venv
PY        := $(VENV)/bin/python
UNAME     := $(shell uname -s)
OPENBLAS  := /usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0
ifeq ($(UNAME),Linux)
  EXTRAS  := cpu,dev
  RUNENV  := LD_PRELOAD=$(OPENBLAS)
else
  EXTRAS  := dev
  RUNENV  :=
endif
PYTEST_ARGS ?=
# The Swift package (apps/swift, EdgespecKit) is built and tested after pytest when a
# Swift toolchain is found: `swift` on PATH, else /opt/swift. Without one it is skipped.
SWIFT     ?= $(shell command -v swift 2>/dev/null || { test -x /opt/swift/usr/bin/swift && echo /opt/swift/usr/bin/swift; })
SWIFT_FIXTURE := .cache/swift-test
# A hung Swift test ends the run after 15 minutes instead of holding CI (they take ~10 s).
SWIFT_TIMEOUT := $(shell command -v timeout >/dev/null 2>&1 && echo timeout 900)

.PHONY: chat test swift-test setup openblas clean

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check --upgrade pip
	$(PY) -m pip install -q --disable-pip-version-check -e ".[$(EXTRAS)]"
	# CPU build of torch, only for the Hugging Face reference tests.
	$(PY) -m pip install -q --disable-pip-version-check "torch==2.13.0" || $(PY) -m pip install -q --disable-pip-version-check torch
	touch $@

openblas:
ifeq ($(UNAME),Linux)
	@test -f $(OPENBLAS) || { (apt-get update -qq && apt-get install -y -qq libopenblas0-pthread) >/dev/null 2>&1 \
	  || sudo sh -c 'apt-get update -qq && apt-get install -y -qq libopenblas0-pthread' >/dev/null 2>&1; }
	@test -f $(OPENBLAS) || echo "warning: could not install libopenblas0-pthread; MLX falls back to its slow reference BLAS"
endif

setup: $(VENV)/.installed openblas

chat: setup
	$(RUNENV) $(VENV)/bin/edgespec chat

test: setup
	$(RUNENV) $(PY) -m pytest $(PYTEST_ARGS)
	@$(MAKE) --no-print-directory swift-test

# The Swift tests start real `edgespec serve` processes on a tiny random bundle, and
# compare with the Python API's replies, both written by tests/swift_fixture.py.
# Steps: the fixture, then `swift build` and `swift test` in apps/swift.
swift-test: setup
ifeq ($(strip $(SWIFT)),)
	@echo "swift-test: SKIPPED: no Swift toolchain (no swift on PATH, no /opt/swift/usr/bin/swift); EdgespecKit not built or tested"
else
	$(RUNENV) $(PY) tests/swift_fixture.py $(SWIFT_FIXTURE)
	cd apps/swift && $(SWIFT) build
	cd apps/swift && EDGESPEC_TEST_PYTHON=$(abspath $(PY)) EDGESPEC_TEST_FIXTURE=$(abspath $(SWIFT_FIXTURE)) \
	  EDGESPEC_TEST_PRELOAD="$(if $(RUNENV),$(OPENBLAS))" $(SWIFT_TIMEOUT) $(SWIFT) test
endif

clean:
	rm -rf $(VENV) .cache .pytest_cache apps/swift/.build
