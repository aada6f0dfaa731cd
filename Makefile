# The two commands of the README: `make serve` and `make test`.
# Both create .venv when it is missing.  On a machine without a GPU the pinned
# CPU build of torch is installed before the project, so that no dependency
# range pulls a multi-GB CUDA build.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0

.PHONY: serve test lint install proto clean-venv

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "torch==$(TORCH_VERSION)"
	$(PY) -m pip install -q -e ".[test]"
	touch $@

# the shipped model's GPTQ int4 copy (routed experts quantized): `tandem serve --model models/tiny-moe-int4`
QUANT_DEMO := models/tiny-moe-int4/config.json
$(QUANT_DEMO): $(VENV)/.installed models/tiny-moe/model.safetensors
	rm -rf models/tiny-moe-int4
	$(PY) -m deploy.cli quantize --format gptq-int4 --out models/tiny-moe-int4

install: $(VENV)/.installed $(QUANT_DEMO)

serve: install
	$(PY) -m deploy.cli serve

test: install lint
	$(PY) -m pytest -q tests

# ruff (lint, import order) and mypy (typed defs) over the hand-written packages
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

proto: install
	$(PY) -m proto.build

clean-venv:
	rm -rf $(VENV)

# Every CUDA path and its figures in one run (bench/gpu_check.py, issue 23).  No install: it
# runs from a plain checkout on a GPU machine too, with the venv's python when there is one.
# GPU_CHECK_ARGS, e.g. "--json --out /tmp/gpu.json" or "--quick".
.PHONY: gpu-check
gpu-check:
	PYTHONPATH=.$${PYTHONPATH:+:$$PYTHONPATH} $(if $(wildcard $(PY)),$(PY),$(PYTHON)) -m bench.gpu_check $(GPU_CHECK_ARGS)
