# Entry points for a fresh clone: `make demo`, `make test`, `make test-maintained`, `make lint` and `make bench`.
# Each creates its virtual environment on first use and reinstalls when setup.cfg, pyproject.toml or the
# constraints file change. Two environments (README: Installation):
#   .venv             Python 3.11 + onnxruntime-training 1.19.2 (constraints.txt): both gradient builders
#   .venv-maintained  the maintained onnxruntime (constraints-maintained.txt): the torch gradient builder
# `make test-maintained PYTHON=python3.12` builds .venv-maintained-3.12 instead (and so on for 3.13).
PYTHON ?= python3.11
# pyenv machines: make every installed version's pythonX.Y resolvable, whatever the global version is
export PYENV_VERSION ?= $(shell pyenv versions --bare 2>/dev/null | sort -rV | tr '\n' ':' | sed 's/:$$//')
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# (make 4.3 passes no exported variable to $(shell): PYENV_VERSION is given explicitly)
PYVER := $(shell PYENV_VERSION='$(PYENV_VERSION)' $(PYTHON) -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null)
ifeq ($(PYVER),)
$(error $(PYTHON) was not found: set PYTHON to a Python 3.11-3.13 interpreter, e.g. make test-maintained PYTHON=python3.12)
endif
VENV_M := .venv-maintained$(if $(filter 3.11,$(PYVER)),,-$(PYVER))
PY_M := $(VENV_M)/bin/python
STAMP_M := $(VENV_M)/.installed

.PHONY: test test-maintained coverage lint demo bench clean

$(STAMP): setup.cfg pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -c constraints.txt -e '.[ort-training,test,examples,lint]'
	touch $(STAMP)

$(STAMP_M): setup.cfg pyproject.toml constraints-maintained.txt
	test -x $(PY_M) || $(PYTHON) -m venv $(VENV_M)
	$(PY_M) -m pip install -q -c constraints-maintained.txt -e '.[cpu,test,examples]'
	touch $(STAMP_M)

test: $(STAMP)
	$(PY) -m pytest

# The same suite on the maintained onnxruntime: tests that need onnxruntime-training skip, saying so.
test-maintained: $(STAMP_M)
	$(PY_M) -m pytest

# The coverage tables, regenerated on the maintained runtime: PyTorch's module_db/op_db through the torch builder
# (docs/torch_builder_coverage.md and tests/torch_coverage_known.py; the default lanes test a sample of the entries,
# this runs them all), op_db's integer and bool samples through the direct translation, and the onnx package's
# backend node cases through OnnxModule (docs/onnx_coverage.md).
COVERAGE_JSON := benchmarks/results
coverage: $(STAMP_M)
	mkdir -p $(COVERAGE_JSON)
	PYTHONPATH=. $(PY_M) tests/torch_coverage.py --run module_db --json $(COVERAGE_JSON)/module_db.json
	PYTHONPATH=. $(PY_M) tests/torch_coverage.py --run op_db --json $(COVERAGE_JSON)/op_db.json
	PYTHONPATH=. $(PY_M) tests/torch_coverage.py --table $(COVERAGE_JSON)/module_db.json $(COVERAGE_JSON)/op_db.json \
		--known $(COVERAGE_JSON)/module_db.json $(COVERAGE_JSON)/op_db.json
	PYTHONPATH=. $(PY_M) tests/test_onnx_conformance.py
	$(PY_M) -m pytest -m "sweep or not sweep" tests/test_torch_builder_module_db.py tests/test_torch_builder_op_db.py \
		tests/test_aten_onnx_op_db_values.py

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
	rm -rf $(VENV) .venv-maintained* *.egg-info .pytest_cache
