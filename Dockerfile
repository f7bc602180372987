# kvledger: the exporter image. Runtime dependencies only, a non-root user, `kvledger serve`
# by default (the configuration is mounted at /etc/kvledger/kvledger.yml), a HEALTHCHECK on
# /-/healthy.
#
#   docker build -t kvledger:0.2.0.dev0 --build-arg KVLEDGER_REVISION=$(git rev-parse HEAD) .
#   docker run --rm -p 9477:9477 kvledger:0.2.0.dev0 demo --listen 0.0.0.0:9477
#   docker run --rm -p 9477:9477 -v $PWD/kvledger.yml:/etc/kvledger/kvledger.yml:ro kvledger:0.2.0.dev0
#
# NVML: run with the NVIDIA container runtime (NVIDIA_DRIVER_CAPABILITIES=utility injects
# libnvidia-ml.so.1); without it, `nvml.enabled: auto` finds no library and exports no GPUs.
# What tests/test_deploy_container.py checks is in docs/deploying.md ("Container image").

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# ---- build: a venv holding kvledger and its runtime dependencies (wheels; no compiler needed)
FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
COPY pyproject.toml setup.py README.md LICENSE ./
COPY exporter/ exporter/
COPY engine/ engine/
# the build context has no .git: the revision that kvledger --version and kvledger_build_info
# report comes from --build-arg KVLEDGER_REVISION=$(git rev-parse HEAD), else it is unknown
ARG KVLEDGER_REVISION=
# non-editable installs of the daemon and the engine-side library it depends on: no test
# extra, no pip or setuptools left to run
RUN python3 -m venv /opt/kvledger \
 && /opt/kvledger/bin/pip install --no-compile /src/engine /src \
 && /opt/kvledger/bin/pip uninstall --yes pip setuptools \
 && /opt/kvledger/bin/python -m compileall -q /opt/kvledger/lib \
 && /opt/kvledger/bin/kvledger --version

# ---- runtime: the base image plus the venv, nothing else
FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="kvledger" \
      org.opencontainers.image.description="KV-cache accounting exporter for LLM inference servers" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN useradd --system --uid 65532 --user-group --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin kvledger
COPY --from=build /opt/kvledger /opt/kvledger
ENV PATH=/opt/kvledger/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    KVLEDGER_HEALTH_URL=http://127.0.0.1:9477/-/healthy
# numeric, so Kubernetes' runAsNonRoot can verify it
USER 65532:65532
EXPOSE 9477
# /-/healthy answers while the process serves; behind basic auth or TLS set KVLEDGER_HEALTH_URL
# (https://...) or use the orchestrator's probe instead (the Kubernetes manifests do).
HEALTHCHECK --interval=30s --timeout=5s --start-period=10s --retries=3 \
  CMD ["python3", "-c", "import os, urllib.request; urllib.request.urlopen(os.environ['KVLEDGER_HEALTH_URL'], timeout=4)"]
ENTRYPOINT ["kvledger"]
CMD ["serve", "--config", "/etc/kvledger/kvledger.yml"]
