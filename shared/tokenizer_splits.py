"""Split patterns of pre-tokenizers that GGUF files name (`tokenizer.ggml.pre`) and that no
pattern of the `tokenizers` library builds: the regular expressions each model's own
tokenizer.json splits text with, in order, before byte-level BPE (shared/tokenizer.py).

They are a specification, not code of ours: a split must match the published tokenizer's
exactly, so they are kept as the model's tokenizer (and llama.cpp, src/llama-vocab.cpp) lists
them. tests/test_gguf_deepseek.py holds the result to llama.cpp's own test vectors.
"""

from __future__ import annotations

# DeepSeek LLM, DeepSeek-V2 and V2-Lite (`deepseek-llm`): newlines, Latin/Greek/Cyrillic/... word
# runs with one leading space, ASCII and full-width punctuation runs, trailing spaces, CJK and
# Hangul runs, digit runs.
DEEPSEEK_LLM_SPLITS = (
    '[\r\n]',
    '\\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-ώᾀ-ᾴᾶ-ᾼιῂ-ῄῆ-ῌῐ-ΐῖ-Ίῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤΩℨK-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+',  # noqa: E501 (one character class)
    '\\s?[!-/:-~！-／：-～‘-‟\u3000-。]+',
    '\\s+$',
    '[一-龥ࠀ-一가-\ud7ff]+',
    '\\p{N}+',
)
