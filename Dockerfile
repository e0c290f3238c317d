# syntax=docker/dockerfile:1.7
# Two images from one file:
#   --target api     CPU-only FastAPI front end (never imports torch at run time, but the
#                    package depends on it, so the small CPU wheel is installed)
#   --target worker  Celery worker with the CUDA build of torch (the wheels bundle the CUDA
#                    runtime; the host needs only the NVIDIA driver + container toolkit)
# Both install the same pins as the README's `make setup` (scripts/setup.sh):
# torch==2.13.0 first, then the package and its pinned dependencies.

ARG PYTHON=python:3.11-slim-bookworm

FROM ${PYTHON} AS base
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 PATH=/opt/venv/bin:$PATH
RUN python -m venv /opt/venv && useradd --create-home --uid 10001 maec
WORKDIR /srv

# ---- build stages: a virtualenv each, copied into slim run stages ----
# A C compiler for the compiled kernels (maec_core/native), in the build stages only.
FROM base AS build-base
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

FROM build-base AS build-cpu
RUN pip install "torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu
COPY pyproject.toml README.md ./
COPY maec_client maec_client
COPY maec_contract maec_contract
COPY maec_core maec_core
COPY app app
COPY worker worker
RUN pip install ./maec_client
RUN pip install .
# Built into the installed package, which the run stage copies with the virtualenv.
RUN python -m maec_core.native

FROM build-base AS build-cuda
RUN pip install "torch==2.13.0"
COPY pyproject.toml README.md ./
COPY maec_client maec_client
COPY maec_contract maec_contract
COPY maec_core maec_core
COPY app app
COPY worker worker
RUN pip install ./maec_client
# The worker runs lm_eval eval sets (pyproject.toml's lm-eval extra).
RUN pip install ".[lm-eval]"
# Built into the installed package, which the run stage copies with the virtualenv.
RUN python -m maec_core.native

# ---- run stages ----
FROM base AS api
COPY --from=build-cpu /opt/venv /opt/venv
USER maec
EXPOSE 8000
# The addresses whose X-Forwarded-For uvicorn believes (--proxy-headers): none, unless the
# deployment names its proxy here (docs/deploy.md). uvicorn's own default, 127.0.0.1,
# would let anything connecting from inside the container pick its client address.
ENV FORWARDED_ALLOW_IPS=""
HEALTHCHECK --interval=10s --timeout=3s \
  CMD python -c "import httpx; httpx.get('http://127.0.0.1:8000/healthz').raise_for_status()"
CMD ["uvicorn", "app.api.main:create_app", "--factory", "--host", "0.0.0.0", "--port", "8000", \
     "--proxy-headers", "--no-access-log"]

FROM base AS worker
COPY --from=build-cuda /opt/venv /opt/venv
ENV NVIDIA_VISIBLE_DEVICES=all NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    MAEC_WORK_DIR=/var/lib/maec
RUN mkdir -p /var/lib/maec && chown maec /var/lib/maec
USER maec
CMD ["celery", "-A", "worker.celery_app", "worker", "-Q", "merges", "-c", "1", \
     "--loglevel", "INFO", "--without-gossip", "--without-mingle"]
