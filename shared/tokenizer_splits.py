"""Split patterns of pre-tokenizers that GGUF files name (`tokenizer.ggml.pre`) and that no
pattern of the `tokenizers` library builds: the regular expressions each model's own
tokenizer.json splits text with, in order, before byte-level BPE (shared/tokenizer_gguf.py).

They are a specification, not code of ours: a split must match the published tokenizer's
exactly, so they are kept as the model's tokenizer (and llama.cpp, src/llama-vocab.cpp) lists
them. tests/test_gguf_deepseek.py and tests/test_gguf_tokenizers.py hold them to references.
"""

from __future__ import annotations

# DeepSeek LLM, DeepSeek-V2 and V2-Lite (`deepseek-llm`): newlines, Latin/Greek/Cyrillic/... word
# runs with one leading space, ASCII and full-width punctuation runs, trailing spaces, CJK and
# Hangul runs, digit runs.
DEEPSEEK_LLM_SPLITS = (
    "[\r\n]",
    "\\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-ώᾀ-ᾴᾶ-ᾼιῂ-ῄῆ-ῌῐ-ΐῖ-Ίῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤΩℨK-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+",  # noqa: E501 (one character class)
    "\\s?[!-/:-~！-／：-～‘-‟\u3000-。]+",
    "\\s+$",
    "[一-龥ࠀ-一가-\ud7ff]+",
    "\\p{N}+",
)

# Llama 3 and the files that name its split (`llama3`, `llama-bpe`, `dbrx`, `pixtral`, ...):
# English contractions, letter runs with one leading non-letter, digit runs of one to three.
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# DeepSeek-V3 and R1 (`deepseek-v3`): digit runs of one to three, CJK ideograph and kana runs,
# then a GPT-4-like split that keeps an ASCII punctuation mark with the letters after it.
DEEPSEEK_V3_SPLITS = (
    r"\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
    r"""| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""",
)

# Qwen2, Qwen2.5, Qwen3 and the DeepSeek-R1 distills of Qwen (`qwen2`, `deepseek-r1-qwen`):
# Llama 3's split with every digit on its own (Qwen2's tokenizer.json).
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Mistral NeMo and the later Mistral models with the Tekken vocabulary (`tekken`): words cut
# before an upper-case letter that follows lower-case ones, each digit on its own (Mistral's
# tekken.json).
TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# GPT-4o's split, which Phi-4-mini and Llama 4 files name (`gpt-4o`, `llama4`): Tekken's word
# rule with English contractions kept on the word, digit runs of one to three (tiktoken's
# o200k_base).
GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
