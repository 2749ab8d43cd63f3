"""splitserve: disaggregated prefill/decode LLM serving.

The installed name maps the repository's folders (setup.py says how):

| import name          | folder              | what                                            |
| -------------------- | ------------------- | ----------------------------------------------- |
| splitserve           | services/           | the gateway, the pods, the planner, the CLI     |
| splitserve.engine    | shared/             | the engine core the services share              |
| splitserve.kernels   | kernels/            | Triton kernels, their references, C++ CPU ones  |
| splitserve.v1        | proto/splitserve/v1 | the gRPC stubs (the proto package's own name)   |

`LLM`, `AsyncLLM`, `SamplingParams` and `LoRARequest` load on first use: the gateway imports
`splitserve.engine.tokenizer` and must not pay for (or need) torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from splitserve.engine.async_llm import AsyncLLM
    from splitserve.engine.llm import LLM
    from splitserve.engine.lora.request import LoRARequest
    from splitserve.engine.sampling_params import SamplingParams

__all__ = ["LLM", "AsyncLLM", "SamplingParams", "LoRARequest"]

_LAZY = {
    "LLM": "splitserve.engine.llm",
    "AsyncLLM": "splitserve.engine.async_llm",
    "SamplingParams": "splitserve.engine.sampling_params",
    "LoRARequest": "splitserve.engine.lora.request",
}


def __getattr__(name: str) -> object:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'splitserve' has no attribute {name!r}")
    return getattr(importlib.import_module(module_name), name)
