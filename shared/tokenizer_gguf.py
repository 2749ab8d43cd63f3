"""The `tokenizers` backend a GGUF file's tokenizer metadata describes, as llama.cpp runs it.

A GGUF file carries no `tokenizer.json`, only llama.cpp's description of one: the vocabulary,
its merges or scores, token types, a pre-tokenizer name and flags. Two kinds of vocabulary:

- "gpt2": byte-level BPE with merges, after the split its `tokenizer.ggml.pre` names
  (shared/tokenizer_splits.py holds the patterns no `tokenizers` pre-tokenizer builds);
- "llama": SentencePiece pieces and scores (shared/tokenizer_spm.py).

Control tokens become special tokens and user-defined ones added tokens, matched whole in the
text as llama.cpp matches them.
"""

from __future__ import annotations

import gguf
import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers

from splitserve.engine.gguf_metadata import GGUFMetadata
from splitserve.engine.tokenizer_splits import (
    DEEPSEEK_LLM_SPLITS,
    DEEPSEEK_V3_SPLITS,
    GPT4O_SPLIT,
    LLAMA3_SPLIT,
    QWEN2_SPLIT,
    TEKKEN_SPLIT,
)
from splitserve.engine.tokenizer_spm import SPACE, sentencepiece_bpe

# llama.cpp token types (gguf.TokenType): CONTROL tokens are special (skipped when decoding),
# USER_DEFINED ones are matched whole in text but decode like ordinary text.
_CONTROL = int(gguf.TokenType.CONTROL)
_USER_DEFINED = int(gguf.TokenType.USER_DEFINED)

SUPPORTED_GGUF_TOKENIZERS = ("gpt2", "llama")

# llama.cpp's pre-tokenizer names (tokenizer.ggml.pre) grouped by the split they stand for.
_GPT2_PRE = ("default", "gpt2", "mpt", "olmo", "jais")
_DIGITS_PRE = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva")
_SPLITS_OF_PRE = {
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx", "falcon3", "pixtral"),
        (LLAMA3_SPLIT,),
    ),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), (QWEN2_SPLIT,)),
    "tekken": (TEKKEN_SPLIT,),
    **dict.fromkeys(("gpt-4o", "llama4"), (GPT4O_SPLIT,)),
    "deepseek-llm": DEEPSEEK_LLM_SPLITS,
    "deepseek-v3": DEEPSEEK_V3_SPLITS,
}


def gguf_backend(meta: GGUFMetadata) -> tokenizers.Tokenizer:
    """The file's vocabulary, split and marked tokens; ValueError naming what is unsupported."""
    model_type = meta.get("tokenizer.ggml.model")
    if model_type not in SUPPORTED_GGUF_TOKENIZERS:
        raise ValueError(
            f"unsupported GGUF tokenizer model {model_type!r}; "
            f"supported: {', '.join(SUPPORTED_GGUF_TOKENIZERS)}"
        )
    is_sentencepiece = model_type == "llama"
    backend = sentencepiece_bpe(meta) if is_sentencepiece else _byte_level_bpe(meta)
    _add_marked_tokens(backend, meta.get("tokenizer.ggml.token_type", []), is_sentencepiece)
    return backend


def adds_bos(meta: GGUFMetadata) -> bool:
    """Whether encoding puts BOS first: the file's flag, else llama.cpp's default (SentencePiece
    vocabularies do; older Llama 2 and Mistral files have no flag)."""
    default = meta.get("tokenizer.ggml.model") == "llama"
    return bool(meta.get("tokenizer.ggml.add_bos_token", default))


def _byte_level_bpe(meta: GGUFMetadata) -> tokenizers.Tokenizer:
    tokens: list[str] = meta.get("tokenizer.ggml.tokens")
    merges: list[str] = meta.get("tokenizer.ggml.merges", [])
    if not tokens:
        raise ValueError("GGUF tokenizer has no tokenizer.ggml.tokens")
    vocab = {token: token_id for token_id, token in enumerate(tokens)}
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=_split_merges(merges)))
    backend.pre_tokenizer = _gguf_pre_tokenizer(meta.get("tokenizer.ggml.pre", "default"))
    backend.decoder = decoders.ByteLevel()
    return backend


def _split_merges(merges: list[str]) -> list[tuple[str, str]]:
    pairs = [tuple(merge.split(" ")) for merge in merges]
    for merge, pair in zip(merges, pairs):
        if len(pair) != 2:
            raise ValueError(f"GGUF merge {merge!r} is not two space-separated tokens")
    return pairs  # type: ignore[return-value]


def _gguf_pre_tokenizer(name: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if name in _GPT2_PRE:
        return byte_level
    if name in _DIGITS_PRE:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if name in _SPLITS_OF_PRE:
        return _splits_then_bytes(_SPLITS_OF_PRE[name])
    supported = ", ".join((*_GPT2_PRE, *_DIGITS_PRE, *_SPLITS_OF_PRE))
    raise ValueError(f"unsupported GGUF pre-tokenizer {name!r}; supported: {supported}")


def _splits_then_bytes(patterns: tuple[str, ...]) -> pre_tokenizers.PreTokenizer:
    """Text split by each pattern in turn (each match its own piece), then mapped to bytes."""
    splits = [pre_tokenizers.Split(Regex(pattern), behavior="isolated") for pattern in patterns]
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    return pre_tokenizers.Sequence([*splits, byte_level])


def _add_marked_tokens(
    backend: tokenizers.Tokenizer, token_types: list[int], is_sentencepiece: bool
) -> None:
    # Without registering them, "<|im_start|>" in text would be cut into "<", "|", "im", ...
    control, user_defined = [], []
    for token_id, token_type in enumerate(token_types):
        if token_type not in (_CONTROL, _USER_DEFINED):
            continue
        token = backend.id_to_token(token_id)  # as the backend spells it (Gemma's spaces)
        if token is None:
            continue
        if token_type == _CONTROL:
            control.append(AddedToken(token, special=True, normalized=False))
        else:
            # A SentencePiece piece of spaces (Gemma's runs of spaces, spelled "▁" here) is
            # matched after spaces are written as "▁", as llama.cpp matches it in the text.
            normalized = is_sentencepiece and not token.strip(SPACE)
            user_defined.append(AddedToken(token, special=False, normalized=normalized))
    backend.add_special_tokens(control)
    backend.add_tokens(user_defined)
