"""Which CPU path each kernel family takes on this machine, and why: the one report of it.

The decisions themselves live beside their kernels (the C++ module's variant in
splitserve.kernels.cpu.isa, the quantized products' checks in quantized_linear.py, the bfloat16
linear in linear.py), each made once at start-up from the CPU's features and what the library
accepts; this module gathers them into the plain dict `splitserve env --json` prints and pods
log at start. Reading it runs each family's start-up check (a small product each, and the C++
module's build the first time on a machine), nothing more.
"""

from __future__ import annotations

from types import ModuleType

from splitserve.engine.model import linear, quantized_linear
from splitserve.kernels import cpu as cpu_kernels
from splitserve.kernels.cpu import isa

_QUANTIZATION_METHODS = ("int8", "int4", "gguf")


def cpu_report() -> dict[str, object]:
    """{"cpu": {...features, the kernels' ISA variant, torch's dispatch...},
    "cpu_kernels": "loaded" | "unavailable: <why>",
    "quantization": {"int8": "ok" | "<why not>", "int4": ..., "gguf": ...},
    "dtypes": {"bfloat16": "ok" | "<why not>"},
    "paths": {family: what runs},
    "model_families": {model_type: how its decode steps run}} (plain values only: JSON-ready)."""
    return {
        "cpu": isa.features_report(),
        "cpu_kernels": cpu_kernels_status(),
        "quantization": {method: quantization_status(method) for method in _QUANTIZATION_METHODS},
        "dtypes": {"bfloat16": bfloat16_status()},
        "paths": kernel_paths(),
        "model_families": model_family_paths(),
    }


def cpu_kernels_status() -> str:
    try:
        module = cpu_kernels.load()
    except ValueError as error:  # a SPLITSERVE_CPU_ISA this CPU cannot run: the engine refuses
        return f"unavailable: {error}"
    return "loaded" if module is not None else f"unavailable: {cpu_kernels.unavailable_reason()}"


def _loaded_module() -> ModuleType | None:
    try:
        return cpu_kernels.load()
    except ValueError:  # cpu_kernels_status says why
        return None


def quantization_status(method: str) -> str:
    """"ok" when `method`'s packed products run right here; otherwise why the engine would
    build the model dense instead."""
    kernels = ("int8",) if method == "int8" else ("int8", "int4")
    for kernel in kernels:
        try:
            problem = quantized_linear.cpu_kernel_problem(kernel)
        except ValueError as error:  # a SPLITSERVE_CPU_ISA this CPU cannot run
            return str(error)
        if problem is not None:
            return f"{kernel} products: {problem}"
    return "ok"


def bfloat16_status() -> str:
    """bfloat16 models always run (plain torch linear where oneDNN's bfloat16 path is not
    accepted): "ok"."""
    return "ok"


def kernel_paths() -> dict[str, str]:
    """Family -> the path it takes here, with the reason where it is not the fastest."""
    module = _loaded_module()
    int4 = quantized_linear.int4_kernel_problem() if module is not None else cpu_kernels_status()
    int8 = quantized_linear.int8_by_int8_problem()
    bf16 = linear.onednn_bfloat16_problem()
    return {
        "float32_linear": "onednn" if linear.onednn_available() else "torch",
        "bfloat16_linear": "onednn" if bf16 is None else f"torch ({bf16})",
        "int8_many_rows": "int8 x int8" if int8 is None else f"float32 weight ({int8})",
        "int4": f"int4_gemm {module.int4_isa()}" if module and int4 is None else f"torch ({int4})",
        "cpu_kernel_isa": module.int4_isa() if module is not None else "none",
    }


# config.json model_type -> what its layers add that decode_layers.cpp does not compute
# (shared/model/fused_decode.py's fused_decode_problem decides per loaded model; this is the
# same answer for each family's usual config, for the report).
_FUSED_FAMILIES = ("llama", "mistral", "phi3", "qwen2", "qwen3", "gemma2", "gemma3_text")
_PYTHON_LAYER_PARTS = {
    "mixtral": "mixture-of-experts",
    "qwen2_moe": "mixture-of-experts",
    "qwen3_moe": "mixture-of-experts",
    "deepseek_v2": "mixture-of-experts, multi-head latent attention",
    "deepseek_v3": "mixture-of-experts (biased sigmoid routing), multi-head latent attention",
}


def model_family_paths() -> dict[str, str]:
    """Model type -> "fused C++ decode" where its dense float32 decode steps may take the C++
    layers (kernels/cpu/decode_layers.cpp), else the Python layers and why (docs/models.md)."""
    fused = (
        "fused C++ decode (float32 activations; float32, int8 or int4 weights; LoRA rows too)"
        if _loaded_module()
        else "python layers"
    )
    paths = {name: fused for name in _FUSED_FAMILIES}
    for model_type, parts in _PYTHON_LAYER_PARTS.items():
        paths[model_type] = f"python layers (the C++ decode layers lack {parts})"
    return paths
