# Two commands: `make demo` (the main job) and `make test` (the whole suite).
# Both create .venv on first use and are quick once it is installed.
# `make tensorboard` then opens the demo's live dashboards (the venv is not activated, so the
# console scripts are run from .venv/bin; TENSORBOARD_ARGS="--port 6007" passes options on).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The CPU build of torch that lies on disk on these machines; a bare `torch` would pull CUDA.
TORCH_SPEC ?= torch==2.13.0

TENSORBOARD_ARGS ?=

.PHONY: demo tensorboard test lint bench gpu-check clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

demo: $(VENV)/.installed
	$(PY) examples/demo.py

tensorboard: $(VENV)/.installed
	@test -d demo_output/runs || { echo "no demo_output/runs yet: run 'make demo' first" >&2; exit 1; }
	$(VENV)/bin/tensorboard --logdir demo_output/runs $(TENSORBOARD_ARGS)

test: $(VENV)/.installed
	$(PY) -m pytest

lint: $(VENV)/.installed
	$(PY) -m ruff check spectral_callbacks tests examples benchmarks
	$(PY) -m mypy spectral_callbacks

bench: $(VENV)/.installed
	$(PY) benchmarks/svd_accuracy.py
	$(PY) benchmarks/overhead.py

# The device machine as it is: its system python3 (torch with CUDA, lightning, pytest, ...), no venv,
# no network. Prints one table (GPU tests, overhead, copy vs main-thread time, SVD, figures) in <= 8 min;
# on a machine without CUDA it says "no CUDA device: nothing measured" and exits 0.
GPU_PYTHON ?= python3
gpu-check:
	PYTHONPATH=. $(GPU_PYTHON) benchmarks/gpu_check.py

clean:
	rm -rf $(VENV) demo_output
