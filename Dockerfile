# syntax=docker/dockerfile:1
# The inference gateway: `docker build -t inference-gateway:0.1.0 .`
# Stage 1 builds wheels for the gateway and its dependencies; stage 2 installs them into a clean
# slim image without build tools and runs as an unprivileged user.
ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS wheels
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY policies ./policies
COPY gateway ./gateway
RUN pip wheel --wheel-dir /wheels .

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="inference-gateway" \
      org.opencontainers.image.description="Queue backpressure in front of GPU model servers" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
RUN --mount=type=bind,from=wheels,source=/wheels,target=/wheels \
    pip install --no-index --find-links=/wheels /wheels/inference_gateway-*.whl \
    && groupadd --system --gid 10001 gateway \
    && useradd --system --uid 10001 --gid gateway --no-create-home --shell /usr/sbin/nologin gateway
# A config that starts without a backend (not ready until one answers); mount your own over it.
COPY deploy/config/gateway.yaml /etc/inference-gateway/gateway.yaml
# Numeric, so that Kubernetes' runAsNonRoot can check it.
USER 10001:10001
EXPOSE 8080
# The probe reads the config to ask /healthz where it is served: the client port, or admin_listen's.
HEALTHCHECK --interval=15s --timeout=3s --start-period=10s --retries=3 \
    CMD ["inference-gateway", "probe", "--config", "/etc/inference-gateway/gateway.yaml"]
ENTRYPOINT ["inference-gateway", "serve"]
CMD ["--config", "/etc/inference-gateway/gateway.yaml"]
