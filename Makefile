# The two commands of the README's quickstart. Each creates .venv when needed.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_OPTS := -n 2 --dist loadgroup --durations=10

.PHONY: demo test test-newest lint clean

$(STAMP): pyproject.toml zerojax/_src/version.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test,tpu,examples]" ruff
	touch $(STAMP)

demo: $(STAMP)
	JAX_PLATFORMS=cpu $(PY) examples/demo.py

test: $(STAMP)
	$(PY) -m ruff check zerojax tests examples
	JAX_PLATFORMS=cpu $(PY) -m pytest $(PYTEST_OPTS) $(PYTEST_ARGS)

# The same suite on the newest JAX, in a Python 3.13 root (as root; see tools/newest-jax).
test-newest:
	tools/newest-jax $(PYTEST_OPTS) $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) demo_out .pytest_cache
