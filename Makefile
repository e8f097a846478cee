# The two commands the README promises, each working on a fresh machine with only Python 3.11.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint proto bench clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and pinned: the CPU wheel is local; an unpinned torch would pull CUDA.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/kvd demo

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check kvd tests benchmarks
	$(VENV)/bin/mypy kvd benchmarks
	$(VENV)/bin/lint-imports

# Regenerate kvd/proto from protos/kvd.proto (tests/test_proto.py fails when it is stale).
proto: $(STAMP)
	$(PY) -m kvd.proto.generate

bench: $(STAMP)
	$(VENV)/bin/kvd bench

clean:
	rm -rf $(VENV) .venv-vllm .venv-vllm-* .pytest_cache .mypy_cache .ruff_cache
