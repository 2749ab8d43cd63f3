"""Where the model lives and what it is called, without importing torch."""

from __future__ import annotations

import os

from splitserve.engine.model_paths import default_model_path
from splitserve.engine.tokenizer import Tokenizer


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
