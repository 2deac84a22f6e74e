# trainmem — two commands do everything on a fresh machine:
#   make run    create .venv, install, estimate Llama-3.1-8B on an H100
#   make test   install what the tests need, run pytest
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
PY     := $(BIN)/python
PIP    := $(PY) -m pip --disable-pip-version-check -q

.PHONY: run test test-slow bench validate gpu-validate ship-derived install install-test clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch is optional for `estimate`; tests, trace and measure need it. Keep an
# importable torch; otherwise take a locally provided wheel if pip's find-links
# has one (see tools/torch_requirement.py), else the index's default build.
$(VENV)/.torch: | $(PY)
	@$(PY) -c "import torch" 2>/dev/null || $(PIP) install "$$($(PY) tools/torch_requirement.py)"
	@touch $@

$(VENV)/.installed: pyproject.toml | $(PY)
	$(PIP) install -e .
	@touch $@

# DeepSpeed (the tests that trace `--zero` through its engine): an sdist whose setup.py imports torch,
# so it is built against the installed torch (--no-build-isolation; an isolated build would pull a CUDA
# torch) with no kernels (DS_BUILD_OPS=0); pinned, as the traces it runs are compared with the estimate
DEEPSPEED ?= deepspeed==0.19.8
$(VENV)/.installed-test: pyproject.toml $(VENV)/.torch | $(PY)
	$(PIP) install -e ".[test]"
	$(PIP) install setuptools wheel
	DS_BUILD_OPS=0 $(PIP) install --no-build-isolation "$(DEEPSPEED)"
	@touch $@

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

run: $(VENV)/.installed
	$(BIN)/trainmem estimate llama-3.1-8b --gpu h100 --fsdp full --dp 8 --batch-size 2 --seq-len 4096 --recompute full --attention flash

test: $(VENV)/.installed-test
	$(PY) -m pytest -q

test-slow: $(VENV)/.installed-test
	$(PY) -m pytest -q -m slow

bench: $(VENV)/.installed-test
	@for b in benchmarks/bench_*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

validate: $(VENV)/.installed-test
	$(BIN)/trainmem validate

# The GPU validation campaign (docs/measure.md): real training runs on the visible CUDA device, one
# subprocess each, appended to RESULTS as they finish; stops before BUDGET seconds, and the same command
# resumes it. It runs from src/ with the machine's own python (torch, transformers, peft, nvidia-ml-py)
# and installs nothing. Fixtures of the finished runs go to FIXTURES; `make validate` scores them.
CAMPAIGN   ?= validation/campaigns/gpu.json
RESULTS    ?= validation/measured/gpu.jsonl
FIXTURES   ?= validation/measured
BUDGET     ?= 540
GPU_PYTHON ?= python3
gpu-validate:
	PYTHONPATH=src$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_PYTHON) -m trainmem validate --campaign $(CAMPAIGN) --results $(RESULTS) \
		--into $(FIXTURES) --budget-s $(BUDGET) $(CAMPAIGN_FLAGS)

# the catalogue's derived architectures: shipped profiles and coefficients (after a catalogue,
# transformers or derivation change; tests/test_derived.py says when they are stale)
ship-derived: $(VENV)/.installed-test
	$(PY) tools/ship_derived.py

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache .hypothesis
