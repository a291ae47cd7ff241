# One command each for a fresh machine: `make quickstart` (the main job on the embedded model) and
# `make test` (the whole test suite, slow tests included). Both install what they need first.
PYTHON ?= python3

.PHONY: install quickstart test test-fast

install:
	$(PYTHON) -m pip install -q -r requirements.txt
	$(PYTHON) -m pip install -q --no-deps -r requirements-nodeps.txt

quickstart: install
	$(PYTHON) main.py fit --config configs/quickstart.yaml

test: install
	$(PYTHON) -m pytest -q -ra

test-fast: install
	$(PYTHON) -m pytest -q -ra -m "not slow"
