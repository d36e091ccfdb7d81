# syntax=docker/dockerfile:1
#
# Two images from one file:
#   docker build -t sd-controller .                      # the controller sidecar (default)
#   docker build --target vllm -t vllm-sd-launcher .     # vLLM + `sd-controller launch`
# The sidecar runs `sd-controller run`; the vLLM container runs
# `sd-controller launch -- python -m vllm.entrypoints.openai.api_server ...` so that the
# controller can restart vLLM with or without --speculative-config.

# Any image with python3 (>= 3.11) and pip: the official one by default, or a base made of
# Debian packages (see docs/deployment.md, "Building the image from Debian packages").
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
ARG VLLM_IMAGE=vllm/vllm-openai:v0.32.0

# --- build: one wheel, no compilers in the runtime images ---------------------------------
FROM ${PYTHON_IMAGE} AS build
# Debian's own python3 refuses pip installs without this (PEP 668); python:* images ignore it.
ENV PIP_BREAK_SYSTEM_PACKAGES=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY controller ./controller
# The project and all its dependencies as wheels; later stages install offline from here.
RUN python3 -m pip wheel --no-cache-dir --wheel-dir /wheels .

# --- vllm: the serving container, launcher in front of vLLM -------------------------------
FROM ${VLLM_IMAGE} AS vllm
COPY --from=build /wheels /tmp/wheels
# Without --upgrade, pip keeps the vLLM image's own numpy/pydantic/... when they satisfy us.
RUN pip install --no-cache-dir --no-index --find-links=/tmp/wheels /tmp/wheels/sd_controller-*.whl \
    && rm -rf /tmp/wheels
# vLLM images run as root by default; the pod spec sets runAsUser for this container.
USER 1000:1000
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=3s --start-period=600s --retries=3 \
    CMD ["python3", "-c", "import urllib.request,sys; urllib.request.urlopen('http://127.0.0.1:8091/healthz', timeout=2); sys.exit(0)"]
ENTRYPOINT ["sd-controller", "launch"]
CMD ["--", "python3", "-m", "vllm.entrypoints.openai.api_server", "--host", "0.0.0.0", "--port", "8000"]

# --- controller: the sidecar (last stage, so it is the default target) ---------------------
FROM ${PYTHON_IMAGE} AS controller
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_BREAK_SYSTEM_PACKAGES=1 \
    SD_CONTROLLER_EXPORTER_PORT=9464
COPY --from=build /wheels /tmp/wheels
RUN python3 -m pip install --no-cache-dir --no-index --find-links=/tmp/wheels /tmp/wheels/sd_controller-*.whl \
    && rm -rf /tmp/wheels \
    && useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin sd \
    && mkdir -p /var/lib/sd-controller /etc/sd-controller \
    && chown sd /var/lib/sd-controller
USER 10001:10001
EXPOSE 9464
HEALTHCHECK --interval=15s --timeout=3s --start-period=20s --retries=3 \
    CMD ["python3", "-c", "import urllib.request,sys; urllib.request.urlopen('http://127.0.0.1:9464/healthz', timeout=2); sys.exit(0)"]
ENTRYPOINT ["sd-controller"]
CMD ["run"]
