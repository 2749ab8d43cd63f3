"""The shipped GGUF model as a Hugging Face directory, for a peer that reads only those.

transformers dequantizes the GGUF to float32 when it loads it but refuses to save a model it
loaded from GGUF, so the model is rebuilt from its config, given the loaded state dict and saved
from there. Both systems then serve the same float32 values: our engine dequantizes the same
file the same way (tests/test_engine_parity.py checks it token for token).
"""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_DIR = Path("build/smollm2-hf")


def ensure_hf_export(directory: Path = DEFAULT_DIR) -> Path:
    """The directory (config, safetensors weights, tokenizer), exported once."""
    if (directory / "config.json").exists() and (directory / "tokenizer.json").exists():
        return directory
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    from splitserve.engine.model_paths import default_model_path

    print(f"[hf-export] writing {directory} from the shipped GGUF", flush=True)
    folder, name = os.path.split(default_model_path())
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = loaded.config
    # The loaded config says its weights were GGUF-quantized; the saved ones are float32.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = LlamaForCausalLM(config)
    model.load_state_dict(loaded.state_dict())
    model.to(torch.float32).save_pretrained(directory)
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(directory)
    return directory


if __name__ == "__main__":
    print(ensure_hf_export())
