# Entry points for a fresh clone: `make demo`, `make test` and `make bench`. Each creates .venv (Python 3.11) on
# first use and reinstalls when setup.cfg, pyproject.toml or constraints.txt change.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test lint demo bench clean

$(STAMP): setup.cfg pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -c constraints.txt -e '.[test,examples,lint]'
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest

# The style and type gates CI runs before the tests.
lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy

# BERT-style pretraining on the standard library's source, a few minutes on a 2-core CPU.
# Longer: make demo ARGS="--steps 2000"
demo: $(STAMP)
	$(PY) examples/pretrain_mlm.py $(ARGS)

bench: $(STAMP)
	$(PY) benchmarks/run_all.py $(ARGS)

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
