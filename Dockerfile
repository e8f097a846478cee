# kvd sidecar image. One file, two variants; every runtime dependency pinned
# by constraints.txt (the versions the test suite ran with):
#   docker build -t kvd:cpu .                                  (CPU torch wheel)
#   docker build -t kvd:cuda --build-arg VARIANT=cuda .        (CUDA torch, for CUDA IPC regions)
ARG PYTHON_VERSION=3.11.7
ARG VARIANT=cpu

FROM python:${PYTHON_VERSION}-slim-bookworm AS build
ARG VARIANT
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
RUN python -m venv /opt/kvd
COPY pyproject.toml README.md constraints.txt ./
COPY kvd ./kvd
COPY protos ./protos
RUN if [ "$VARIANT" = "cuda" ]; then \
        /opt/kvd/bin/pip install torch==2.13.0 ; \
    else \
        /opt/kvd/bin/pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu ; \
    fi \
 && /opt/kvd/bin/pip install -c constraints.txt . \
 && find /opt/kvd -name '__pycache__' -prune -exec rm -rf {} +

FROM python:${PYTHON_VERSION}-slim-bookworm
LABEL org.opencontainers.image.title="kvd" \
      org.opencontainers.image.description="KV-cache transfer daemon for disaggregated prefill/decode serving"
COPY --from=build /opt/kvd /opt/kvd
RUN groupadd --system --gid 10001 kvd && useradd --system --uid 10001 --gid kvd --no-create-home kvd
ENV PATH=/opt/kvd/bin:$PATH PYTHONUNBUFFERED=1 \
    KVD_HOST=0.0.0.0 KVD_GRPC_PORT=50051 KVD_DATA_PORT=50052 KVD_METRICS_PORT=9400
USER 10001:10001
EXPOSE 50051 50052 9400
HEALTHCHECK --interval=10s --timeout=5s --start-period=20s --retries=3 \
    CMD ["python", "-m", "kvd.healthcheck"]
ENTRYPOINT ["kvd", "serve"]
