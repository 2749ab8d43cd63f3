"""The saved transformers references (conftest.py's `hf_reference_tokenizer` and
`hf_reference_model`) are what transformers loads from the GGUF itself: the parity tests compare
against the saved copies, so a conversion that lost a weight, a special token or the chat
template would pass them against a wrong reference. Slow: it pays the ~35 s GGUF load the saved
copies exist to avoid."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import reference_model_from_gguf, reference_tokenizer_from_gguf

pytestmark = pytest.mark.slow

TEXTS = [
    "Hello world, how are you?",
    "h\u00e9llo  w\u00f6rld\n\tx",
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    " 12345 and 3.14159 ",
    "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8",
    "def f(x):\n    return x ** 2  # square\n",
]


def test_the_saved_reference_equals_transformers_own_gguf_load(
    smollm2_gguf_path, hf_reference_tokenizer, hf_reference_model
):
    tokenizer = reference_tokenizer_from_gguf(smollm2_gguf_path)
    model = reference_model_from_gguf(smollm2_gguf_path)
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert hf_reference_tokenizer.encode(text) == ids, text
        assert hf_reference_tokenizer.decode(ids) == tokenizer.decode(ids)
    assert hf_reference_tokenizer.all_special_tokens == tokenizer.all_special_tokens
    assert hf_reference_tokenizer.chat_template == tokenizer.chat_template
    assert _architecture(hf_reference_model.config) == _architecture(model.config)
    saved, loaded = hf_reference_model.state_dict(), model.state_dict()
    assert saved.keys() == loaded.keys()
    assert all(torch.equal(saved[name], loaded[name]) for name in saved)
    ids = torch.tensor([tokenizer.encode(TEXTS[0] + TEXTS[5])])
    with torch.no_grad():
        assert torch.equal(hf_reference_model(ids).logits, model(ids).logits)


def _architecture(config) -> dict:
    """A config's settings, without where it was read from and how its weights were stored."""
    where = ("_name_or_path", "architectures", "quantization_config", "transformers_version")
    return {key: value for key, value in config.to_dict().items() if key not in where}
