# Quick start: `make demo` (the main job) and `make test`; each sets up .venv itself.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch's CUDA (or ROCm) wheel brings the Triton it requires. Its CPU wheel requires none:
# there the Triton interpreter runs the kernels under INTERPRETER_TRITON, any Triton torch
# ships (3.6-3.9), e.g. `make test INTERPRETER_TRITON=3.6.0 VENV=.venv-3.6`.
INTERPRETER_TRITON ?= 3.9.0
# Triton 3.6's interpreter indexes with 1-element arrays, which NumPy 2.4 refuses
# (triton-lang/triton#9171, fixed in 3.7).
INTERPRETER_PINS := triton==$(INTERPRETER_TRITON) $(if $(filter 3.6.%,$(INTERPRETER_TRITON)),"numpy<2.4")
STAMP := $(VENV)/.installed-$(shell cksum requirements-test.txt | cut -d' ' -f1)-$(INTERPRETER_TRITON)

.PHONY: setup build test demo lint bench report e2e results upload clean precompile

setup: $(STAMP)

$(STAMP): requirements-test.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -r requirements-test.txt
	@if $(PY) -c "import sys, torch; sys.exit(bool(torch.version.cuda or torch.version.hip))"; \
	then $(PY) -m pip install -q $(INTERPRETER_PINS); fi
	rm -f $(VENV)/.installed-* && touch $@

build: $(STAMP)
	$(PY) scripts/build.py

test: build
	$(PY) -m pytest -q

demo: build
	$(PY) scripts/demo.py

# Kernels compiled on the CPU for the GPU (docs/precompiled.md), for each Triton torch ships
# (each wheel installed once under .triton/, beside this venv's torch) and every target in
# scripts/precompile.py's GPUS, into torch-ext/fused_geglu/precompiled/; the build then
# ships them. E.g. `make precompile PRECOMPILE_TRITONS=3.9.0 PRECOMPILE_ARGS="--arch 90"`.
PRECOMPILE_TRITONS ?= 3.6.0 3.7.1 3.8.0 3.9.0
precompile: build
	for v in $(PRECOMPILE_TRITONS); do \
	  test -d .triton/$$v/triton || \
	    $(PY) -m pip install -q --no-deps --target .triton/$$v triton==$$v || exit 1; \
	  env -u TRITON_INTERPRET PYTHONPATH=.triton/$$v $(PY) scripts/precompile.py $(PRECOMPILE_ARGS) \
	    || exit 1; \
	done
	$(PY) scripts/build.py

# Profiling report into benchmarks/out/; e.g. `make report ARGS="--tokens 1 64"`.
report: build
	$(PY) scripts/report.py $(ARGS)

# Gemma-2B-shaped model, eager against kernelized (CUDA GPU); e.g. `make e2e ARGS="--layers 2"`.
e2e: build
	$(PY) benchmarks/e2e.py $(ARGS)

# The results in README.md (a summary) and docs/results.md, from benchmarks/results/*.json.
results: $(STAMP)
	$(PY) scripts/render_results.py

# Builds (with the precompiled kernels), checks and uploads to the Hub;
# `make upload ARGS=--dry-run` sends nothing.
upload: precompile
	$(PY) scripts/upload.py $(ARGS)

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

clean:
	rm -rf build
