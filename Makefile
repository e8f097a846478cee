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

# Bytecode for this checkout first: every daemon, CLI and engine process imports kvd from here, and
# where PYTHONDONTWRITEBYTECODE is set (CI) each would compile it again (0.45 s of CPU a process).
# Without PYTEST_ARGS, each test runs in one of three passes. The real-engine tests run one at a
# time in the foreground, every engine bound to its cores as the README says; they leave about one
# core of two idle (the driver's engines all sit on core 0), so kvd's own tests run beside them at
# nice 10, taking only what the engines leave (their output is printed when both are done, and is
# in $(VENV)/own-tests.log meanwhile). The vLLM environments build at the start; an engine test
# that needs one still building waits for it. Last, alone, the tests marked alone (they depend on
# the whole machine). All three always run; make fails if one did (its Error line names the first
# failure's exit status), and Ctrl-C stops the background ones too. Each pass's
# output is also in $(VENV)/<pass>-tests.log, and the last lines recap each pass's result and failures.
# pyproject.toml's addopts deselect these too; each pass's own -m replaces that one.
NOT_IN_MAKE_TEST := not latency and not zoo_hetero
test: $(STAMP)
	@$(PY) -m compileall -q kvd tests benchmarks
ifeq ($(strip $(PYTEST_ARGS)),)
	@rm -f $(VENV)/*-tests.rc; \
	$(PY) -m tests.vllm_env > $(VENV)/vllm-envs.log 2>&1 & envs=$$!; \
	nice -n 10 $(PY) -m pytest -m "not vllm and not alone and $(NOT_IN_MAKE_TEST)" > $(VENV)/own-tests.log 2>&1 & own=$$!; \
	trap 'kill $$own $$envs 2>/dev/null; exit 130' INT TERM; \
	echo "== the real-engine tests, one at a time (kvd's own tests run beside them: $(VENV)/own-tests.log)"; \
	{ $(PY) -m pytest -m "vllm and $(NOT_IN_MAKE_TEST)"; echo $$? > $(VENV)/engine-tests.rc; } 2>&1 | tee $(VENV)/engine-tests.log; \
	engines=$$(cat $(VENV)/engine-tests.rc 2>/dev/null); \
	wait $$own; own_rc=$$?; echo "== kvd's own tests, run beside them"; cat $(VENV)/own-tests.log; \
	wait $$envs; grep '^\[vllm env\] .*: ' $(VENV)/vllm-envs.log; \
	echo "== the tests marked alone"; \
	{ $(PY) -m pytest -m "alone and $(NOT_IN_MAKE_TEST)"; echo $$? > $(VENV)/alone-tests.rc; } 2>&1 | tee $(VENV)/alone-tests.log; \
	alone=$$(cat $(VENV)/alone-tests.rc 2>/dev/null); \
	echo "== make test: each pass's result and failures (the whole output is above)"; \
	for pass in engine own alone; do \
	  echo "$$pass: $$(grep -E '^=+ .* in [0-9.]+s' $(VENV)/$$pass-tests.log | tail -1)"; grep -E '^(FAILED|ERROR) ' $(VENV)/$$pass-tests.log; \
	done; \
	for rc in $${engines:-1} $$own_rc $${alone:-1}; do if [ $$rc -ne 0 ]; then exit $$rc; fi; done
else
	$(PY) -m pytest $(PYTEST_ARGS)
endif

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
