"""The tokenizer and chat template against transformers on the same files."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import gguf
import pytest

from splitserve.engine.chat_template import ChatTemplate
from splitserve.engine.tokenizer import Tokenizer

_VOCAB_KEYS = ("tokens", "merges", "token_type")
# Enough vocabulary for tests that only need a GGUF to parse (SmolLM2's takes seconds to read).
TINY_VOCAB = {
    "tokens": ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "a", "b", "ab"],
    "merges": ["a b"],
    "token_type": [3, 3, 3, 1, 1, 1],
}
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PARITY_TEXTS = [
    "Hello, world!",
    "naïve café — Ünïcödé straße, ÆØÅ",
    "emoji 🤖🚀 and a family 👩‍👩‍👧 ✨",
    "digits 3.14159, 1234567890 and -42e10",
    "   leading spaces, inner   runs and trailing   ",
    "tabs\tand\nnewlines\n\n\nthree\r\nwindows",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "inline<|im_end|>special<file_sep>tokens <|endoftext|>end",
    'def square(x: int) -> int:\n    """Doc."""\n    return x ** 2  # {braces} [1:]\n',
    "中文 日本語のテキスト 한국어 العربية",
    "it's we'll they've I'M you'D",
    "",
]

CONVERSATIONS = {
    "single": [{"role": "user", "content": "What is 2+2?"}],
    "multi": [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke.\nA short one."},
    ],
    "system_single": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a colour."},
    ],
    "system_multi": [
        {"role": "system", "content": "You answer in French."},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Bonjour"},
        {"role": "user", "content": "Thanks 🤖"},
    ],
}


@pytest.fixture(scope="module")
def smollm2_reader(smollm2_gguf_path: str) -> gguf.GGUFReader:
    return gguf.GGUFReader(smollm2_gguf_path)  # parsing takes seconds: read once


@pytest.fixture(scope="module")
def tokenizer(smollm2_reader: gguf.GGUFReader) -> Tokenizer:
    return Tokenizer.from_gguf_reader(smollm2_reader)


@pytest.fixture(scope="module")
def smollm2_vocab(smollm2_reader: gguf.GGUFReader) -> dict[str, list]:
    """SmolLM2's tokens, merges and token types, for writing tokenizer-only GGUF files."""
    fields = smollm2_reader.fields
    return {key: fields[f"tokenizer.ggml.{key}"].contents() for key in _VOCAB_KEYS}


# ---- encode / decode against transformers' GGUF tokenizer ------------------------------------


@pytest.mark.parametrize("add_special_tokens", [True, False])
@pytest.mark.parametrize("text", PARITY_TEXTS)
def test_encode_matches_transformers(tokenizer, hf_reference_tokenizer, text, add_special_tokens):
    expected = hf_reference_tokenizer(text, add_special_tokens=add_special_tokens).input_ids
    assert tokenizer.encode(text, add_special_tokens=add_special_tokens) == expected


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("text", PARITY_TEXTS)
def test_decode_round_trips_and_matches_transformers(
    tokenizer, hf_reference_tokenizer, text, skip_special_tokens
):
    ids = tokenizer.encode(text)
    decoded = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    assert decoded == hf_reference_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    if not skip_special_tokens:
        assert decoded == text


def test_digits_are_split_one_by_one_like_llama_cpp_smollm(tokenizer):
    # SmolLM2's GGUF names the "smollm" pre-tokenizer: llama.cpp (and the model's original
    # tokenizer.json) isolate each digit before the GPT-2 split, so a space run before a
    # number stays one token. transformers' GGUF tokenizer skips that step and yields
    # "Ġ", "Ġ" here; the vocabulary has no multi-digit tokens, so it agrees everywhere else.
    ids = tokenizer.encode("x  12")
    assert tokenizer.convert_ids_to_tokens(ids) == ["x", "ĠĠ", "1", "2"]
    assert tokenizer.decode(ids) == "x  12"


def test_special_tokens_of_smollm2(tokenizer, hf_reference_tokenizer):
    assert tokenizer.vocab_size == 49152
    assert tokenizer.bos_token_id == 1 == hf_reference_tokenizer.bos_token_id
    assert tokenizer.eos_token_id == 2 == hf_reference_tokenizer.eos_token_id
    # id 2 is <|im_end|>, the end-of-turn token of the chat template, so it is the only stop id.
    assert tokenizer.convert_ids_to_tokens(2) == "<|im_end|>"
    assert tokenizer.eos_token_ids == (2,)
    # The 17 CONTROL tokens: <|endoftext|>, <|im_start|>, <|im_end|>, <repo_name>, ...
    assert tokenizer.all_special_ids == tuple(range(17))
    assert tokenizer.is_special(2) and not tokenizer.is_special(17)
    assert tokenizer.encode("<|im_start|>") == [1]
    assert tokenizer.encode("hi", add_special_tokens=True) == tokenizer.encode("hi", False)
    sample = [0, 1, 2, 16, 17, 198, 1000, 49151]
    assert tokenizer.convert_ids_to_tokens(sample) == hf_reference_tokenizer.convert_ids_to_tokens(
        sample
    )
    assert tokenizer.token_to_id("<|im_end|>") == 2


def test_decode_rejects_out_of_range_ids(tokenizer):
    with pytest.raises(ValueError, match="ids"):
        tokenizer.decode([5, 49152])
    with pytest.raises(ValueError, match="ids"):
        tokenizer.decode([-1])
    with pytest.raises(ValueError, match="text"):
        tokenizer.encode(123)  # type: ignore[arg-type]


# ---- chat template ---------------------------------------------------------------------------


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_chat_template_matches_transformers(
    tokenizer, hf_reference_tokenizer, name, add_generation_prompt
):
    messages = CONVERSATIONS[name]
    expected = hf_reference_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert tokenizer.apply_chat_template(messages, add_generation_prompt) == expected


def test_chat_template_exact_text_for_one_turn(tokenizer):
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert prompt == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


@pytest.mark.parametrize(
    "messages",
    [
        "hello",
        [],
        ["hello"],
        [{"content": "no role"}],
        [{"role": "", "content": "empty role"}],
        [{"role": "user"}],
        [{"role": "user", "content": None}],
        [{"role": "user", "content": 42}],
    ],
)
def test_bad_messages_raise_value_error(tokenizer, messages):
    with pytest.raises(ValueError, match=r"^messages"):
        tokenizer.apply_chat_template(messages)


def test_template_raise_exception_becomes_value_error():
    template = ChatTemplate(
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}"
        "{% endif %}{{ messages[0]['content'] }}"
    )
    assert template.render([{"role": "user", "content": "ok"}]) == "ok"
    with pytest.raises(ValueError, match="messages rejected by the chat template: first must be"):
        template.render([{"role": "assistant", "content": "no"}])


def test_template_is_sandboxed_and_has_hf_helpers():
    escape = ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ValueError, match="messages rejected"):
        escape.render([{"role": "user", "content": "x"}])
    # tojson keeps "<" and non-ASCII as they are (Jinja's own escapes them); bos_token is passed.
    helpers = ChatTemplate("{{ bos_token }}{{ messages[0] | tojson }}", {"bos_token": "<s>"})
    rendered = helpers.render([{"role": "user", "content": "<b>é"}])
    assert rendered == '<s>{"role": "user", "content": "<b>é"}'


def test_model_without_template_rejects_messages(tmp_path):
    path = _write_tokenizer_gguf(tmp_path / "plain.gguf", TINY_VOCAB, pre="gpt2")
    plain = Tokenizer.from_gguf(path)
    assert plain.chat_template is None
    assert plain.encode("ab<|im_end|>ba") == [5, 2, 4, 3]
    assert plain.eos_token_ids == (2,)
    with pytest.raises(ValueError, match="no chat template"):
        plain.apply_chat_template([{"role": "user", "content": "hi"}])


# ---- other sources and pre-tokenizers ----------------------------------------------------------


def test_from_hf_dir_matches_transformers(tiny_hf_checkpoint):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tiny_hf_checkpoint)
    ours = Tokenizer.from_hf_dir(tiny_hf_checkpoint)
    for text in PARITY_TEXTS:
        assert ours.encode(text) == hf(text).input_ids
    for messages in CONVERSATIONS.values():
        assert ours.apply_chat_template(messages) == hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
    assert (ours.bos_token_id, ours.eos_token_id, ours.eos_token_ids) == (1, 2, (2,))


def test_from_hf_dir_honours_add_bos_and_generation_eos(tiny_hf_checkpoint, tmp_path):
    shutil.copy(os.path.join(tiny_hf_checkpoint, "tokenizer.json"), tmp_path)
    config = {
        "bos_token": {"content": "<|im_start|>"},
        "eos_token": "<|im_end|>",
        "add_bos_token": True,
        "chat_template": "{{ messages[0]['content'] }}<|im_end|>",
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    ours = Tokenizer.from_hf_dir(tmp_path)
    assert ours.encode("hi") == [1, *ours.encode("hi", add_special_tokens=False)]
    assert ours.eos_token_ids == (2, 0)
    assert ours.apply_chat_template([{"role": "user", "content": "x"}]) == "x<|im_end|>"


def test_from_hf_dir_without_tokenizer_json(tmp_path):
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path)


def test_llama3_pre_tokenizer_matches_transformers(smollm2_vocab, tmp_path):
    """A GGUF naming llama.cpp's "llama-bpe" split (Llama 3), with add_bos_token set."""
    from transformers import AutoTokenizer

    path = _write_tokenizer_gguf(
        tmp_path / "llama3.gguf", smollm2_vocab, pre="llama-bpe", add_bos=True
    )
    ours = Tokenizer.from_gguf(path)
    hf = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="llama3.gguf")
    texts = [*PARITY_TEXTS, "Hello  12345 world's\n\n  x", "I'M   fine\r\n ok"]
    for text in texts:
        assert ours.encode(text) == hf(text).input_ids, text
    assert ours.encode("hi")[0] == 1


def test_unsupported_gguf_tokenizers_are_rejected(tmp_path):
    unigram = _write_tokenizer_gguf(tmp_path / "t5.gguf", TINY_VOCAB, pre="default", model="t5")
    with pytest.raises(ValueError, match="tokenizer model 't5'"):
        Tokenizer.from_gguf(unigram)
    chameleon = _write_tokenizer_gguf(tmp_path / "ch.gguf", TINY_VOCAB, pre="chameleon")
    with pytest.raises(ValueError, match="pre-tokenizer 'chameleon'"):
        Tokenizer.from_gguf(chameleon)


def test_tokenizer_module_does_not_import_torch():
    code = (
        "import sys; import splitserve.engine.tokenizer, splitserve.engine.chat_template; "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr


# ---- helpers ---------------------------------------------------------------------------------


def _write_tokenizer_gguf(
    path, vocab: dict[str, list], pre: str, model: str = "gpt2", add_bos: bool = False
) -> str:
    """A GGUF holding only a tokenizer (`vocab`) under the given settings."""
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_tokenizer_model(model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(vocab["tokens"])
    writer.add_token_types(vocab["token_type"])
    writer.add_token_merges(vocab["merges"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(add_bos)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)
