# Two commands do all the set-up on a fresh machine:
#   make train   create .venv, install oases, prepare the demo data, run the default job
#   make test    install oases with its test extra and run the test suite
#   make test-fast   the suite without the end-to-end training runs (the inner loop)
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
NPROC  ?= 2
CONFIG ?= configs/gpt-tiny.yaml
ARGS   ?=

.PHONY: train test test-fast bench-smoke gpu-check gpu-wheels install install-test clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -e .
	touch $@

$(VENV)/.installed-test: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -e '.[test]'
	touch $(VENV)/.installed $@

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

# The default job's corpus: CPython's own documentation, byte-level (nothing downloaded).
data/pydoc/train.bin: | $(VENV)/.installed
	$(BIN)/python -m oases.prepare --builtin pydoc --out data/pydoc

# CUDA_DEVICE_MAX_CONNECTIONS=1 (kernels in issue order; train.py sets it too): yours wins
train: $(VENV)/.installed data/pydoc/train.bin
	$(BIN)/python -m oases.config --config $(CONFIG) --nproc $(NPROC) $(ARGS)
	CUDA_DEVICE_MAX_CONNECTIONS=$${CUDA_DEVICE_MAX_CONNECTIONS:-1} \
	    $(BIN)/torchrun --standalone --nproc_per_node=$(NPROC) train.py --config $(CONFIG) $(ARGS)

# the serial tests (they measure the host's load) run alone after the rest; only their
# files are collected for that run. The suite starts ~150 Python processes: each reuses
# the bytecode of oases that the first compiled, even where PYTHONDONTWRITEBYTECODE is set.
TEST_ENV = PYTHONDONTWRITEBYTECODE=
test: $(VENV)/.installed-test
	$(TEST_ENV) $(BIN)/python -m pytest -q -n 2 --dist loadfile -m "not serial and not bench" tests
	$(TEST_ENV) $(BIN)/python -m pytest -q -m serial $$(grep -l "mark.serial" tests/test_*.py || echo tests)

# Within 3 minutes on 2 cores: leaves out `slow` (trainings through torchrun or train.py,
# compiles, larger cases of what it checks on smaller ones).
test-fast: $(VENV)/.installed-test
	$(TEST_ENV) $(BIN)/python -m pytest -q -n 2 --dist loadfile -m "not slow and not serial and not bench" tests

# Every benchmark's own command at a smoke size, and its report written again from its JSON
# (tests/test_bench_smoke.py): ~11 minutes on 2 cores; the emulated cluster's cases need root
# (sudo make bench-smoke) and skip without it, the GPU benchmarks skip without CUDA.
bench-smoke: $(VENV)/.installed-test
	$(TEST_ENV) $(BIN)/python -m pytest -q -m bench -rs tests/test_bench_smoke.py

# On a machine with CUDA GPUs: waits, host against GPU, the cuda tests, speed and overlap,
# within 9 minutes (docs/gpu-check.md). Offline, with a python3 that has CUDA torch:
#   make gpu-wheels            (here, with network: what such an image lacks, into .whl/)
#   make gpu-check GPU_PYTHON=python3      (there; installs .whl/*.whl into /tmp/site)
GPU_PYTHON ?=
GPU_ENV = CUDA_DEVICE_MAX_CONNECTIONS=$${CUDA_DEVICE_MAX_CONNECTIONS:-1} PYTHONUNBUFFERED=1
ifeq ($(GPU_PYTHON),)
gpu-check: $(VENV)/.installed-test
	$(GPU_ENV) $(BIN)/python -m benchmarks.gpu_check $(ARGS)
else
gpu-check:
	if ls .whl/*.whl >/dev/null 2>&1; then $(GPU_PYTHON) -m pip install -q --no-index \
	    --no-deps --no-compile --target /tmp/site .whl/*.whl; fi
	$(GPU_ENV) PYTHONPATH=$(CURDIR):/tmp/site $(GPU_PYTHON) -m benchmarks.gpu_check $(ARGS)
endif

GPU_WHEEL_PYTHON ?= 3.12
gpu-wheels:
	python3 -m pip download -q --no-deps --only-binary=:all: \
	    --python-version $(GPU_WHEEL_PYTHON) --implementation cp \
	    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl "pulp<4"

clean:
	rm -rf runs wandb .pytest_cache
