"""SentencePiece tokenizers from GGUF files (`tokenizer.ggml.model` = "llama"): Llama 2,
Mistral, Phi-3, Gemma and the other families whose original tokenizer is a SentencePiece model.

A GGUF file keeps such a vocabulary as pieces with scores, not merges. llama.cpp tokenizes it
by merging, again and again, the two neighbouring pieces whose joined text is the
highest-scoring piece of the vocabulary (the leftmost on a tie), after writing spaces as "▁"
and, unless the file says otherwise, putting one before the text. A character no piece spells
becomes its UTF-8 bytes' `<0xXX>` pieces.

The `tokenizers` library's BPE does the same given every join as a merge, ranked by the
score of the piece it makes: that list is built here from the pieces. The two differ only where
pieces of equal score compete for overlapping pairs (llama.cpp takes the leftmost, the list
here the lower id), which unique scores, as Llama 2's and Phi-3's are, rule out.
tests/test_gguf_tokenizers.py holds the result to llama.cpp's own ids for the Llama 2 and
Phi-3 vocabularies.

Gemma's files need two changes, as transformers' GGUF reader makes them (its notes say why; no
Gemma vocabulary is at hand here to check against llama.cpp): their scores do not follow the
order the merges were learned in, the pieces' order in the file does; and pieces of two or more
spaces are stored as spaces, where text reaches the merges with spaces written as "▁".
"""

from __future__ import annotations

import gguf
import tokenizers
from tokenizers import decoders, models, normalizers

from splitserve.engine.gguf_metadata import GGUFMetadata

_NORMAL = int(gguf.TokenType.NORMAL)
SPACE = "\u2581"  # "▁": SentencePiece's spelling of a space
_GEMMA_ARCHITECTURES = ("gemma", "gemma2", "gemma3")


def sentencepiece_bpe(meta: GGUFMetadata) -> tokenizers.Tokenizer:
    """The byte-fallback BPE that tokenizes as llama.cpp's SentencePiece tokenizer does."""
    tokens: list[str] = meta.get("tokenizer.ggml.tokens")
    scores: list[float] = meta.get("tokenizer.ggml.scores", [])
    token_types: list[int] = meta.get("tokenizer.ggml.token_type", [])
    if not tokens:
        raise ValueError("GGUF tokenizer has no tokenizer.ggml.tokens")
    if len(scores) != len(tokens) or len(token_types) != len(tokens):
        raise ValueError(
            "a SentencePiece GGUF tokenizer needs tokenizer.ggml.scores and token_type for "
            f"each of its {len(tokens)} tokens"
        )
    is_gemma = meta.get("general.architecture") in _GEMMA_ARCHITECTURES
    if is_gemma:
        tokens = _spaces_respelled(tokens)
        scores = [-float(token_id) for token_id in range(len(tokens))]  # the file's order
    vocab = {token: token_id for token_id, token in enumerate(tokens)}
    model = models.BPE(
        vocab=vocab,
        merges=_merges_by_score(vocab, scores, token_types),
        unk_token=_unknown_token(meta, tokens),
        fuse_unk=True,
        byte_fallback=True,
    )
    backend = tokenizers.Tokenizer(model)
    # llama.cpp's default; Gemma's tokenizer adds no leading space.
    add_space_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", not is_gemma))
    backend.normalizer = _space_normalizer(add_space_prefix)
    backend.decoder = _space_decoder(add_space_prefix)
    return backend


def _unknown_token(meta: GGUFMetadata, tokens: list[str]) -> str:
    """What a character no piece or byte piece spells becomes; llama.cpp's default id is 0."""
    unknown_id = meta.get("tokenizer.ggml.unknown_token_id", 0)
    if not 0 <= int(unknown_id) < len(tokens):
        raise ValueError(
            f"tokenizer.ggml.unknown_token_id {unknown_id} is not in the {len(tokens)} tokens"
        )
    return tokens[int(unknown_id)]


def _spaces_respelled(tokens: list[str]) -> list[str]:
    """Pieces of two or more spaces spelled with "▁", unless that spelling is taken."""
    taken = set(tokens)
    respelled = []
    for token in tokens:
        spelled = SPACE * len(token)
        is_spaces = len(token) > 1 and not token.strip(" ")
        respelled.append(spelled if is_spaces and spelled not in taken else token)
    return respelled


def _merges_by_score(
    vocab: dict[str, int], scores: list[float], token_types: list[int]
) -> list[tuple[str, str]]:
    """Every (left, right) pair of pieces whose join is an ordinary piece, the join's score
    first (ties by id, then by where the join is cut, so the order is reproducible)."""
    ranked = []
    for token, token_id in vocab.items():
        if token_types[token_id] != _NORMAL:
            continue  # control, byte and unused pieces are never made by joining text
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[token_id], token_id, cut, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _space_normalizer(add_space_prefix: bool) -> normalizers.Normalizer:
    spaces = normalizers.Replace(" ", SPACE)
    if not add_space_prefix:
        return spaces
    # Applied to each stretch of text between special tokens, as llama.cpp puts a space before
    # the text that follows one.
    return normalizers.Sequence([normalizers.Prepend(SPACE), spaces])


def _space_decoder(add_space_prefix: bool) -> decoders.Decoder:
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(" ", 1, 0))  # the space the encoder put in front
    return decoders.Sequence(steps)
