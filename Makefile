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

.PHONY: chat test setup openblas clean

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

clean:
	rm -rf $(VENV) .cache .pytest_cache
