"""Tokenizers rebuilt from GGUF files, held to references:

- SentencePiece vocabularies (`tokenizer.ggml.model` "llama": Llama 2, Mistral, Phi-3) to
  llama.cpp's own ids for its Llama 2 and Phi-3 test vocabularies (tests/data/README.md);
- Gemma's SentencePiece files to transformers' GGUF tokenizer on a vocabulary built to show
  Gemma's two differences (merge order by file position, pieces of spaces);
- the `qwen2` pre-tokenizer to transformers' GGUF tokenizer;
- the `deepseek-v3` pre-tokenizer to DeepSeek-V3's published tokenizer.json pre-tokenizer.

The byte-level pre-tokenizers are checked on DeepSeek LLM's vocabulary cut to its first 16k
merges: the split is what is tested, and a large real vocabulary makes a wrong split show in the
ids. (Whole, its 100k tokens and merges took transformers' GGUF reader ~20 s a file.)
"""

from __future__ import annotations

import functools
import json
import lzma
import tempfile
from dataclasses import dataclass
from pathlib import Path

import gguf
import pytest
import tokenizers

from splitserve.engine.gguf_file import read_gguf
from splitserve.engine.gguf_metadata import GGUFMetadata
from splitserve.engine.tokenizer import Tokenizer

DATA = Path(__file__).parent / "data"

# DeepSeek-V3's tokenizer.json, its "pre_tokenizer" entry (huggingface.co/deepseek-ai/DeepSeek-V3),
# as JSON text: the reference for the `deepseek-v3` pre-tokenizer.
DEEPSEEK_V3_PUBLISHED_PRE_TOKENIZER = r"""{
  "type": "Sequence",
  "pretokenizers": [
    {"type": "Split", "pattern": {"Regex": "\\p{N}{1,3}"}, "behavior": "Isolated",
     "invert": false},
    {"type": "Split", "pattern": {"Regex": "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"},
     "behavior": "Isolated", "invert": false},
    {"type": "Split", "pattern": {"Regex": "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\\r\\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"},
     "behavior": "Isolated", "invert": false},
    {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}
  ]
}"""  # noqa: E501 (one pattern)


def _finish(writer: gguf.GGUFWriter) -> None:
    """Writes the file of a metadata-only GGUF writer."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _llama_cpp_texts() -> list[str]:
    """llama.cpp's 46 tokenizer test texts (the same for every vocabulary)."""
    texts = (DATA / "ggml-vocab-deepseek-llm.gguf.inp").read_text(encoding="utf-8")
    return texts.split("\n__ggml_vocab_test__\n")[:46]


def _unpacked(name: str, tmp_path: Path) -> str:
    path = tmp_path / name
    path.write_bytes(lzma.decompress((DATA / f"{name}.xz").read_bytes()))
    return str(path)


@pytest.mark.parametrize("vocabulary", ["llama-spm", "phi-3"])
def test_sentencepiece_files_give_llama_cpps_ids(tmp_path, vocabulary):
    """Llama 2's and Phi-3's vocabularies as llama.cpp's test files hold them: every one of
    the 46 texts gets llama.cpp's ids (the leading space, spaces as pieces, byte pieces for
    characters no piece spells), and decodes back to itself."""
    tokenizer = Tokenizer.from_gguf(_unpacked(f"ggml-vocab-{vocabulary}.gguf", tmp_path))
    expected = (DATA / f"ggml-vocab-{vocabulary}.gguf.out").read_text().splitlines()
    texts = _llama_cpp_texts()
    assert len(expected) == len(texts) == 46
    for text, ids in zip(texts, expected):
        encoded = tokenizer.encode(text, add_special_tokens=False)
        assert encoded == [int(i) for i in ids.split()], text
        assert tokenizer.decode(encoded) == text


def test_a_sentencepiece_file_adds_bos_and_keeps_its_control_tokens_whole(tmp_path):
    tokenizer = Tokenizer.from_gguf(_unpacked("ggml-vocab-phi-3.gguf", tmp_path))
    ids = tokenizer.encode("<|user|>\nHi<|end|>")
    assert ids[0] == tokenizer.bos_token_id == 1
    assert tokenizer.token_to_id("<|user|>") in ids and tokenizer.token_to_id("<|end|>") in ids
    assert tokenizer.decode(ids) == "\nHi"  # control tokens are skipped when decoding


def _write_sentencepiece_vocab(path: Path, arch: str, add_space_prefix: bool | None) -> None:
    """A small SentencePiece vocabulary whose scores disagree with its file order: by score
    "bc" (-1) joins before "ab" (-5); by position "ab" comes first. "  " and "   " are pieces
    of spaces, stored as spaces and marked user-defined, as llama.cpp's converter writes
    Gemma's."""
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>"] + [f"<0x{byte:02X}>" for byte in range(256)]
    types = [3, 3, 3, 2] + [6] * 256
    pieces = {"\u2581": 0, "a": 0, "b": 0, "c": 0, "h": 0, "e": 0, "l": 0, "o": 0, "\n": 0,
              "ab": -5, "bc": -1, "  ": -2, "he": -3, "ll": -4, "hell": -6, "hello": -7,
              "\u2581hello": -8, "lo": -0.5, "   ": -9}  # fmt: skip
    tokens += list(pieces) + ["<start_of_turn>"]
    types += [4 if not piece.strip(" ") else 1 for piece in pieces] + [3]
    scores = [0.0] * 260 + [float(score) for score in pieces.values()] + [0.0]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_scores(scores)
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(3)
    if add_space_prefix is not None:
        writer.add_add_space_prefix(add_space_prefix)
    _finish(writer)


SMALL_VOCAB_TEXTS = ["abc", "hello  hello", "a   b", "h\u00e9llo", "<start_of_turn>hello\nabc",
                     "  hello", "", "hellohello", "bcab c"]  # fmt: skip


def test_gemma_files_tokenize_as_transformers_reads_them(tmp_path):
    """Gemma's SentencePiece files: merges in the file's order, pieces of spaces matched,
    no leading space; every text as transformers' GGUF tokenizer gives it."""
    transformers = pytest.importorskip("transformers")
    _write_sentencepiece_vocab(tmp_path / "gemma.gguf", "gemma2", add_space_prefix=None)
    ours = Tokenizer.from_gguf(tmp_path / "gemma.gguf")
    reference = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="gemma.gguf")
    for text in SMALL_VOCAB_TEXTS:
        ids = ours.encode(text, add_special_tokens=False)
        assert ids == reference.encode(text, add_special_tokens=False), text
    assert ours.convert_ids_to_tokens(ours.encode("abc", add_special_tokens=False)) == ["ab", "c"]
    assert ours.decode(ours.encode("a   b", add_special_tokens=False)) == "a   b"
    # Pieces of spaces matched whole, the longest first, as llama.cpp matches user-defined ones.
    four = ours.convert_ids_to_tokens(ours.encode("a    b", add_special_tokens=False))
    assert four == ["a", "\u2581\u2581\u2581", "\u2581", "b"]


def test_other_sentencepiece_files_merge_by_score_and_honour_the_space_prefix_flag(tmp_path):
    _write_sentencepiece_vocab(tmp_path / "llama.gguf", "llama", add_space_prefix=None)
    _write_sentencepiece_vocab(tmp_path / "bare.gguf", "llama", add_space_prefix=False)
    llama, bare = (Tokenizer.from_gguf(tmp_path / f"{name}.gguf") for name in ("llama", "bare"))
    assert llama.convert_ids_to_tokens(llama.encode("abc", add_special_tokens=False)) == [
        "\u2581", "a", "bc"
    ]  # fmt: skip
    assert bare.convert_ids_to_tokens(bare.encode("abc", add_special_tokens=False)) == ["a", "bc"]
    assert llama.decode(llama.encode("abc")) == bare.decode(bare.encode("abc")) == "abc"


def test_sentencepiece_files_without_the_flag_add_bos_as_llama_cpp_does(tmp_path):
    _write_sentencepiece_vocab(tmp_path / "old.gguf", "llama", add_space_prefix=None)
    old = Tokenizer.from_gguf(tmp_path / "old.gguf")  # no tokenizer.ggml.add_bos_token
    assert old.encode("abc")[0] == old.bos_token_id == 2
    assert old.encode("abc", add_special_tokens=False)[0] != 2


# DeepSeek LLM's ids below this are its bytes and its first merges' results; its special and
# user-defined tokens (bytes no merge makes among them) start at 100,000.
KEPT_MERGE_RESULTS = 16_000
FIRST_SPECIAL_ID = 100_000


@dataclass(frozen=True)
class ByteLevelVocabulary:
    tokens: list[str]
    types: list[int]
    merges: list[str]
    bos_token_id: int
    eos_token_id: int


@functools.cache
def _deepseek_vocabulary_cut() -> ByteLevelVocabulary:
    """DeepSeek LLM's vocabulary cut to its tokens below KEPT_MERGE_RESULTS and its special
    ones (renumbered to follow them), with the merges whose pieces and result it keeps: still
    a BPE vocabulary, in which a text merges as far as the whole one merges it this far."""
    with tempfile.TemporaryDirectory() as directory:
        source = GGUFMetadata(read_gguf(_unpacked("ggml-vocab-deepseek-llm.gguf", Path(directory))))
        tokens, types = source.get("tokenizer.ggml.tokens"), source.get("tokenizer.ggml.token_type")
        kept = list(range(KEPT_MERGE_RESULTS)) + list(range(FIRST_SPECIAL_ID, len(tokens)))
        kept_tokens = {tokens[i] for i in kept}
        merges = [
            merge
            for merge in source.get("tokenizer.ggml.merges")
            if merge.replace(" ", "", 1) in kept_tokens
            and all(piece in kept_tokens for piece in merge.split(" ", 1))
        ]
        renumbered = {old: new for new, old in enumerate(kept)}
        return ByteLevelVocabulary(
            tokens=[tokens[i] for i in kept],
            types=[types[i] for i in kept],
            merges=merges,
            bos_token_id=renumbered[source.get("tokenizer.ggml.bos_token_id")],
            eos_token_id=renumbered[source.get("tokenizer.ggml.eos_token_id")],
        )


def _byte_level_vocab_as(tmp_path: Path, arch: str, pre: str) -> Tokenizer:
    """The cut DeepSeek LLM vocabulary and merges, written as a file of architecture `arch`
    naming the pre-tokenizer `pre`."""
    vocabulary = _deepseek_vocabulary_cut()
    path = tmp_path / f"{arch}-{pre}.gguf"
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(vocabulary.tokens)
    writer.add_token_types(vocabulary.types)
    writer.add_token_merges(vocabulary.merges)
    writer.add_bos_token_id(vocabulary.bos_token_id)
    writer.add_eos_token_id(vocabulary.eos_token_id)
    _finish(writer)
    return Tokenizer.from_gguf(path)


def _ids(tokenizer, texts: list[str]) -> list[list[int]]:
    return [tokenizer.encode(text, add_special_tokens=False) for text in texts]


@pytest.mark.parametrize("pre", ["qwen2", "deepseek-r1-qwen", "tekken", "gpt-4o", "llama4"])
def test_the_qwen_mistral_and_gpt4o_pre_tokenizers_split_as_transformers_does(tmp_path, pre):
    """Qwen2/2.5/3 files and the R1 distills of Qwen, Mistral's Tekken files, GPT-4o's split
    (Phi-4-mini, Llama 4): the 46 texts' ids equal transformers' GGUF tokenizer's. (GPT-2's
    split gives others; this vocabulary has no token of two digits, so the digit rules of the
    splits do not show in its ids.)"""
    transformers = pytest.importorskip("transformers")
    ours = _byte_level_vocab_as(tmp_path, "qwen2", pre)
    reference = transformers.AutoTokenizer.from_pretrained(
        str(tmp_path), gguf_file=f"qwen2-{pre}.gguf"
    )
    texts = [*_llama_cpp_texts(), "HelloWorld's MIXEDCase aBc 12345"]
    expected = [reference.encode(text, add_special_tokens=False) for text in texts]
    assert _ids(ours, texts) == expected
    assert _ids(_byte_level_vocab_as(tmp_path, "qwen2", "default"), texts) != expected


# Texts on which the splits differ from their neighbours: digit runs, case changes inside a
# word, contractions, a punctuation mark before letters, CJK and kana, indented code.
SPLIT_TEXTS = ["12345 and 3.14159", "HelloWorld's MIXEDCase aBc", "#include <stdio.h>",
               "\u6211\u60f3\u5728apple\u5de5\u4f5c1314151\u5929 \u3072\u3089 \u30ab\u30bf",
               "I've been 'told he's there", "  indented\n\n\tcode();  "]  # fmt: skip
# Each split's nearest neighbour among the others: the test shows the two tell apart.
NEIGHBOUR = {"qwen2": "llama-bpe", "deepseek-r1-qwen": "llama-bpe", "tekken": "qwen2",
             "gpt-4o": "llama-bpe", "llama4": "tekken", "deepseek-v3": "deepseek-llm"}  # fmt: skip


def _pieces(pre_tokenizer, texts: list[str]) -> list[list[str]]:
    return [[piece for piece, _ in pre_tokenizer.pre_tokenize_str(text)] for text in texts]


@pytest.mark.parametrize("pre", ["qwen2", "deepseek-r1-qwen", "tekken", "gpt-4o", "llama4"])
def test_the_splits_cut_text_as_transformers_does_and_apart_from_their_neighbour(tmp_path, pre):
    """Independent of any vocabulary: the pieces each split cuts text into equal those of
    transformers' GGUF tokenizer, and differ from the nearest other split's."""
    transformers = pytest.importorskip("transformers")
    from splitserve.engine.tokenizer_gguf import _gguf_pre_tokenizer

    path = tmp_path / f"{pre}.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(["a", "b", "ab"])
    writer.add_token_merges(["a b"])
    _finish(writer)
    reference = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    texts = [*SPLIT_TEXTS, *_llama_cpp_texts()]
    expected = _pieces(reference.backend_tokenizer.pre_tokenizer, texts)
    assert _pieces(_gguf_pre_tokenizer(pre), texts) == expected
    assert _pieces(_gguf_pre_tokenizer(NEIGHBOUR[pre]), texts) != expected


def test_the_deepseek_v3_split_cuts_text_as_its_published_pre_tokenizer():
    from splitserve.engine.tokenizer_gguf import _gguf_pre_tokenizer

    reference = tokenizers.Tokenizer.from_str(
        json.dumps(
            {"version": "1.0", "model": {"type": "BPE", "vocab": {}, "merges": []},
             "pre_tokenizer": json.loads(DEEPSEEK_V3_PUBLISHED_PRE_TOKENIZER)}
        )
    )  # fmt: skip
    texts = [*SPLIT_TEXTS, *_llama_cpp_texts()]
    expected = _pieces(reference.pre_tokenizer, texts)
    assert _pieces(_gguf_pre_tokenizer("deepseek-v3"), texts) == expected
    assert _pieces(_gguf_pre_tokenizer(NEIGHBOUR["deepseek-v3"]), texts) != expected


def test_the_deepseek_v3_pre_tokenizer_splits_as_its_published_tokenizer(tmp_path):
    """DeepSeek-V3 and R1 files: the 46 texts' ids equal those of the same vocabulary under the
    pre-tokenizer DeepSeek-V3's tokenizer.json publishes. (DeepSeek LLM's split gives the same
    ids on these texts with this vocabulary; GPT-2's gives others.)"""
    ours = _byte_level_vocab_as(tmp_path, "deepseek2", "deepseek-v3")
    published = json.loads(ours.to_json())
    published["pre_tokenizer"] = json.loads(DEEPSEEK_V3_PUBLISHED_PRE_TOKENIZER)
    reference = tokenizers.Tokenizer.from_str(json.dumps(published))
    texts = _llama_cpp_texts()
    expected = [reference.encode(text, add_special_tokens=False).ids for text in texts]
    assert _ids(ours, texts) == expected
    assert _ids(_byte_level_vocab_as(tmp_path, "deepseek2", "default"), texts) != expected


def test_an_unknown_tokenizer_model_is_refused_by_name(tmp_path):
    writer = gguf.GGUFWriter(str(tmp_path / "t5.gguf"), "t5")
    writer.add_tokenizer_model("t5")
    writer.add_token_list(["<pad>", "a"])
    _finish(writer)
    with pytest.raises(ValueError, match="unsupported GGUF tokenizer model 't5'.*gpt2, llama"):
        Tokenizer.from_gguf(tmp_path / "t5.gguf")
