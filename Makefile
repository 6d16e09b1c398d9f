# Two entry points that set themselves up on a fresh machine:
#   make train   -> virtual env + pinned deps, then train the default model on the default corpus
#   make test    -> virtual env + pinned deps, then ruff and the test suite
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.meshlm-installed

.PHONY: setup train test lint bench clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -c constraints.txt torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e ".[test,fp8,data]"
	touch $(STAMP)

setup: $(STAMP)

# The default run: 400 steps of 8 x 256 tokens (0.82 M tokens), decoder blocks compiled when
# a C++ compiler is there (inductor's CPU kernels); ARGS come last and override any of these.
CXX_FOUND      := $(shell command -v $${CXX:-g++} 2>/dev/null)
TRAIN_DEFAULTS := --train.steps=400 --train.global_batch=8 --train.warmup_steps=40 \
                  $(if $(CXX_FOUND),--train.compile=true,)

train: $(STAMP)
	$(VENV)/bin/meshlm train $(TRAIN_DEFAULTS) $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks

# Test files run on TEST_WORKERS parallel workers (pytest-xdist; 0: in this process). Two on
# a 2-core machine: a third keeps the cores no busier (they are ~95 % busy with two) and makes
# every process slower (cold runs: 13:20 and 14:21 with two, 15:29 with three, which spent
# 1,830 CPU-seconds against 1,500-1,600). Files are handed out in the order tests/conftest.py
# gives them (--no-loadscope-reorder).
TEST_WORKERS ?= 2

test: $(STAMP) lint
	OMP_NUM_THREADS=1 $(PY) -m pytest tests -n $(TEST_WORKERS) --dist loadfile \
		--no-loadscope-reorder $(ARGS)

bench: $(STAMP)
	$(PY) benchmarks/single_process.py

clean:
	rm -rf $(VENV) runs .pytest_cache
