# Every target creates the virtual environment on first use and installs what it needs.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
HASH   := $(shell cat pyproject.toml Makefile | cksum | cut -d' ' -f1)
STAMP  := $(VENV)/.installed-$(HASH)
# The benchmarks' extra (matplotlib for their charts), on top of what the tests need.
BENCH_STAMP := $(VENV)/.installed-bench-$(HASH)
# torch 2.13.0: the CPU build on these machines; a newer torch pulls a multi-GB CUDA build.
TORCH  ?= torch==2.13.0

.PHONY: help venv demo test test-fast lint bench bench-lhotse soak fuzz clean

help:
	@echo "make demo | test | lint | bench | bench-lhotse | soak | fuzz | clean"

$(STAMP):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[test,dev,lightning]"
	touch $(STAMP)

$(BENCH_STAMP): $(STAMP)
	$(PY) -m pip install -q -e ".[bench]"
	touch $(BENCH_STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(PY) benchmarks/bench_lhotse.py --demo

test: $(STAMP)
	$(PY) -m pytest -q

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not dist"

lint: $(STAMP)
	$(VENV)/bin/ruff check tensorcast tests benchmarks examples
	$(VENV)/bin/ruff format --check tensorcast
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

bench: $(BENCH_STAMP)
	$(PY) benchmarks/bench_broadcast.py --json bench-results/broadcast.json --png bench-results/broadcast.png

bench-lhotse: $(BENCH_STAMP)
	$(PY) benchmarks/bench_lhotse.py --compare --json bench-results/lhotse.json --png bench-results/lhotse.png

soak: $(STAMP)
	$(PY) benchmarks/soak.py

fuzz: $(STAMP)
	$(PY) benchmarks/fuzz_header.py

clean:
	rm -rf $(VENV) bench-results .pytest_cache .hypothesis .mypy_cache .ruff_cache
