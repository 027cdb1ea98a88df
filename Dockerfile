# specgate: gateway and workers in one image (CPU). Build: docker build -t specgate .
# Run a worker:  docker run -p 8101:8101 specgate worker --model builtin --host 0.0.0.0 --port 8101
# Run the set:   docker run -p 8000:8000 specgate serve --config config/builtin.yaml
# Gateway + two workers wired by env: docker compose up (compose.yaml)
#
# Build arguments:
#   BASE_IMAGE       a Debian-based image with Python 3.11 and its venv module (default the official
#                    python:3.11-slim; scripts/debian-base-image.sh makes one from Debian's packages)
#   TORCH_SPEC       the torch to install (default torch==2.13.0), from TORCH_INDEX_URL too
#   TORCH_INDEX_URL  an extra index for torch alone (default PyTorch's CPU index: no CUDA libraries in
#                    a CPU image; https://download.pytorch.org/whl/cu128 for the gpu overlay's image)
#   PIP_FIND_LINKS, PIP_INDEX_URL, PIP_TRUSTED_HOST   pip's own, for a local wheel house or mirror
# llama.cpp is compiled with GGML_NATIVE=OFF (AVX2/FMA/F16C, not the build machine's own flags): an
# image built on one node runs on another, not only on nodes like it ("illegal instruction"). The image runs as uid 10001, not root, with no
# compiler inside; its root filesystem may be read-only (it writes only under /tmp).
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS build
RUN apt-get update \
 && apt-get install -y --no-install-recommends build-essential cmake \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /srv/specgate
ENV PIP_NO_CACHE_DIR=1 SPECGATE_CACHE_DIR=/srv/specgate/.cache
ARG TORCH_SPEC=torch==2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG PIP_FIND_LINKS
ARG PIP_INDEX_URL
ARG PIP_TRUSTED_HOST
ARG CMAKE_BUILD_PARALLEL_LEVEL=4
COPY pyproject.toml README.md ./
COPY scripts ./scripts
COPY core ./core
COPY app ./app
COPY workers ./workers
COPY clients ./clients
COPY config ./config
# the same set-up script as `make run`, into a virtual environment the next stage copies
RUN python -m venv /opt/specgate \
 && CMAKE_ARGS="-DGGML_NATIVE=OFF" \
    TORCH_SPEC="$TORCH_SPEC" TORCH_INDEX_URL="$TORCH_INDEX_URL" bash scripts/setup.sh /opt/specgate/bin/python \
 && /opt/specgate/bin/python -c "from core.runners import load_runner; load_runner('builtin-draft'); load_runner('builtin-alt')"
# readable by the run-time user, who owns none of it (safetensors writes the dequantized weights 0600)
RUN chmod -R a+rX /srv/specgate /opt/specgate

FROM ${BASE_IMAGE}
# llama.cpp's OpenMP runtime; a user of its own
RUN apt-get update \
 && apt-get install -y --no-install-recommends libgomp1 \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --uid 10001 --user-group --home-dir /tmp --no-create-home specgate
COPY --from=build /opt/specgate /opt/specgate
COPY --from=build /srv/specgate /srv/specgate
WORKDIR /srv/specgate
ENV PATH=/opt/specgate/bin:$PATH SPECGATE_CACHE_DIR=/srv/specgate/.cache HOME=/tmp PYTHONDONTWRITEBYTECODE=1
USER 10001:10001
EXPOSE 8000 8101 8102
ENTRYPOINT ["specgate"]
CMD ["serve", "--config", "config/builtin.yaml"]
