# specgate: gateway and workers in one image (CPU). Build: docker build -t specgate .
# Run a worker:  docker run -p 8101:8101 specgate worker --model builtin --host 0.0.0.0 --port 8101
# Run the set:   docker run -p 8000:8000 specgate serve --config config/builtin.yaml
# Gateway + two workers wired by env: docker compose up (compose.yaml)
FROM python:3.11-slim

# llama-cpp-python compiles from source
RUN apt-get update \
 && apt-get install -y --no-install-recommends build-essential cmake \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /srv/specgate
ENV PIP_NO_CACHE_DIR=1 SPECGATE_CACHE_DIR=/srv/specgate/.cache

# the same set-up script as `make run`: torch first and pinned (pass a CPU index with
# --build-arg PIP_EXTRA_INDEX_URL=... to keep the image small), the project, the built-in model
ARG TORCH_SPEC=torch==2.13.0
ARG PIP_EXTRA_INDEX_URL
COPY pyproject.toml README.md ./
COPY scripts ./scripts
COPY core ./core
COPY app ./app
COPY workers ./workers
COPY clients ./clients
COPY config ./config
RUN CMAKE_BUILD_PARALLEL_LEVEL=4 TORCH_SPEC="$TORCH_SPEC" bash scripts/setup.sh python \
 && python -c "from core.runners import load_runner; load_runner('builtin-draft'); load_runner('builtin-alt')"

EXPOSE 8000 8101 8102
ENTRYPOINT ["specgate"]
CMD ["serve", "--config", "config/builtin.yaml"]
