# The two commands of the README's quickstart. Each creates .venv when needed.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test,tpu,examples]" ruff
	touch $(STAMP)

demo: $(STAMP)
	JAX_PLATFORMS=cpu $(PY) examples/demo.py

test: $(STAMP)
	$(PY) -m ruff check zerojax tests examples
	JAX_PLATFORMS=cpu $(PY) -m pytest -n 2 --dist loadgroup --durations=10 $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) demo_out .pytest_cache
