"""splitserve's engine core, shared by the prefill and decode services.

`LLM`, `AsyncLLM` and `SamplingParams` are imported lazily: the gateway imports
`shared.tokenizer` and `shared.kv.block_hash` and must not pay for (or need) torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shared.async_llm import AsyncLLM
    from shared.llm import LLM
    from shared.sampling_params import SamplingParams

__all__ = ["LLM", "AsyncLLM", "SamplingParams"]

_LAZY = {
    "LLM": "shared.llm",
    "AsyncLLM": "shared.async_llm",
    "SamplingParams": "shared.sampling_params",
}


def __getattr__(name: str) -> object:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'shared' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module_name), name)
