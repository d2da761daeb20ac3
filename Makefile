# Quick start: `make demo` (the main job) and `make test`; each sets up .venv itself.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cksum requirements-test.txt | cut -d' ' -f1)

.PHONY: setup build test demo lint bench report clean

setup: $(STAMP)

$(STAMP): requirements-test.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -r requirements-test.txt
	rm -f $(VENV)/.installed-* && touch $@

build: $(STAMP)
	$(PY) scripts/build.py

test: build
	$(PY) -m pytest -q

demo: build
	$(PY) scripts/demo.py

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

clean:
	rm -rf build
