# Two commands do everything on a fresh clone:
#   make demo   create .venv, install memfit, train the embedded default
#   make test   create .venv, install memfit with test extras, run the tests
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of torch when none is installed; a torch you already have (CUDA
# included, seen through --system-site-packages) is kept.
TORCH_SPEC ?= torch==2.13.0
# deepspeed is in the test extras so that its ZeRO equality tests run on CPU too, and the
# --report-to trackers so that their tests read each tracker's own files back.
# bench brings TRL: the preference and RL objectives are tested against TRL's own losses and tokens.
EXTRAS ?= all,dev,deepspeed,tensorboard,wandb,mlflow,lowmem-optim,tasks,bench
# The demo trains the built-in model in full precision and writes its HTML report: it needs plotly and
# nothing else optional (`make demo DEMO_EXTRAS=all` installs the rest; `make test` installs what the tests need).
DEMO_EXTRAS ?= report
# DeepSpeed's tests run on its CPU accelerator. It compiles its CPU communication op on
# first use (about 35 s on 2 cores); tests/distributed keeps the build in
# ~/.cache/memfit/torch-extensions/<environment>, so later runs reuse it.
export DS_ACCELERATOR ?= cpu

.PHONY: demo test setup lint bench bench-gpu bench-frontier gpu-truth clean

$(BIN)/python:
	$(PYTHON) -m venv --system-site-packages $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.installed-demo: $(BIN)/python pyproject.toml
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[$(DEMO_EXTRAS)]"
	touch $@

$(VENV)/.installed: $(VENV)/.installed-demo
	$(BIN)/python -m pip install -q -e ".[$(EXTRAS)]"
	touch $@

setup: $(VENV)/.installed

demo: $(VENV)/.installed-demo
	$(BIN)/memfit train

# The tests run in one worker per CPU core (pytest-xdist); a test file's tests stay in one worker, and so do
# tests/distributed's shared torchrun launches (tests/conftest.py). TEST_WORKERS=0 runs them in this process.
# pytest-benchmark, when a system site has it, times nothing here and would warn once per worker.
TEST_WORKERS ?= auto

test: setup
	$(BIN)/python -m pytest tests -n $(TEST_WORKERS) --dist loadgroup -p no:benchmark

# ruff, then the import contracts of pyproject.toml (layers, no cycle between files).
lint: setup
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/lint-imports

bench: setup
	$(BIN)/python benchmarks/bench_engine.py

# Every GPU figure of docs/techniques.md and docs/accuracy.md (needs a CUDA device).
bench-gpu: setup
	$(BIN)/python benchmarks/bench_gpu.py --out docs/benchmarks.md

# The frontier runs (8B QLoRA at the planned longest context, 8B full fine-tune at batch 2) under a
# 24 GiB cap on a GPU; reduced shapes on a CPU.
bench-frontier: setup
	$(BIN)/python benchmarks/bench_frontier_gpu.py --out docs/benchmarks.md

# On a CUDA machine, from the checkout on that machine's own torch: make gpu-truth PARTS="tests allocator"
gpu-truth:
	benchmarks/gpu_truth.sh $(PARTS)

clean:
	rm -rf $(VENV) runs
