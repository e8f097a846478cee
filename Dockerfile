# kvd sidecar image. One file for every base and variant:
#   docker build -t kvd:0.2.0 .                                         (python:3.11-slim, CPU torch)
#   docker build -t kvd:0.2.0-cuda --build-arg VARIANT=cuda \
#       --build-arg BASE=<a CUDA runtime image with python3 and venv> .  (CUDA torch, for CUDA IPC regions;
#       nvidia/cuda's own images have no Python: add python3 and python3-venv to one first)
#   deploy/image-test                     (a locally bootstrapped base and a wheelhouse, no registry)
# BASE needs python3 (3.11+) with venv. Packages come from the index, pinned by
# constraints.txt (the versions the test suite ran with), unless the build
# context has wheels in deploy/image/wheelhouse/: then only from there
# (--no-index), which is how a machine with no registry builds it.
ARG BASE=python:3.11-slim-bookworm

FROM ${BASE} AS build
ARG VARIANT=cpu
# The CPU variant takes torch's CPU wheel: the index's default torch carries CUDA (GBs).
ARG TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
RUN python3 -m venv /opt/kvd
COPY deploy/image/ ./image/
COPY pyproject.toml README.md constraints.txt ./
COPY kvd ./kvd
COPY protos ./protos
RUN set -eu; \
    if ls image/wheelhouse/*.whl >/dev/null 2>&1; then \
        /opt/kvd/bin/pip install --no-index --find-links image/wheelhouse -c constraints.txt kvd torch==2.13.0; \
    elif [ "$VARIANT" = "cuda" ]; then \
        /opt/kvd/bin/pip install -c constraints.txt torch==2.13.0 .; \
    else \
        # 2.13.0+cpu satisfies ==2.13.0 and sorts above PyPI's 2.13.0, so pip takes it.
        /opt/kvd/bin/pip install -c constraints.txt --extra-index-url "$TORCH_CPU_INDEX" torch==2.13.0 .; \
    fi; \
    /opt/kvd/bin/pip uninstall -y -q pip setuptools wheel 2>/dev/null || true; \
    find /opt/kvd -name '__pycache__' -prune -exec rm -rf {} +; \
    /opt/kvd/bin/python -c "import kvd.daemon.server, torch; print('kvd image: torch', torch.__version__)"

# Run time: the base, the venv, and a user. No compiler, no pip, no sources.
FROM ${BASE}
LABEL org.opencontainers.image.title="kvd" \
      org.opencontainers.image.description="KV-cache transfer daemon for disaggregated prefill/decode serving" \
      org.opencontainers.image.version="0.2.0"
COPY --from=build /opt/kvd /opt/kvd
RUN (groupadd --system --gid 10001 kvd && useradd --system --uid 10001 --gid kvd --no-create-home kvd) \
    && find /opt/kvd -name '*.pyc' -delete
ENV PATH=/opt/kvd/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 \
    KVD_HOST=0.0.0.0 KVD_GRPC_PORT=50051 KVD_DATA_PORT=50052 KVD_METRICS_PORT=9400
USER 10001:10001
EXPOSE 50051 50052 9400
HEALTHCHECK --interval=10s --timeout=5s --start-period=20s --retries=3 \
    CMD ["python", "-m", "kvd.healthcheck"]
ENTRYPOINT ["kvd", "serve"]
