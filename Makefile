# meshnet — the two commands: `make serve` (run the main job) and `make test` (pass the tests).
# Both set everything up on a fresh clone: a .venv, CPU torch first, the project, the model.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
MESHNET := $(VENV)/bin/meshnet

.PHONY: venv serve test test-fast bench model clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# CPU torch first, so nothing pulls a multi-GB CUDA build
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,quant]'
	touch $@

model: venv
	$(MESHNET) models pull

serve: model
	$(MESHNET) serve

test: model
	$(VENV)/bin/lint-imports    # the package layering (pyproject's [tool.importlinter] contracts)
	$(PY) -m pytest -q

test-fast: venv
	$(PY) -m pytest -q -m "not slow"

bench: model
	$(PY) bench/pipeline.py
	$(PY) bench/placement.py
	$(PY) bench/failover.py
	$(PY) bench/wire_exactness.py
	$(PY) bench/chain.py
	$(PY) bench/batching.py
	$(PY) bench/heartbeats.py
	$(PY) bench/spotcheck.py
	$(PY) bench/relay.py
	$(PY) bench/tracker_entry.py
	$(PY) bench/traffic.py

clean:
	rm -rf $(VENV) .pytest_cache
