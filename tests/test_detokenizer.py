"""IncrementalDetokenizer against the real SmolLM2 tokenizer (byte-level BPE, shipped as GGUF)."""

from __future__ import annotations

import random

import pytest

from splitserve.engine.detokenizer import DetokenizerUpdate, IncrementalDetokenizer
from splitserve.engine.sampling_params import SamplingParams

IM_START, IM_END = 1, 2  # SmolLM2's chat special tokens
CHAT_PROMPT = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def tokenizer(hf_reference_tokenizer):
    """The `tokenizers.Tokenizer` behind the GGUF (transformers' reading of it): its
    `decode(ids, skip_special_tokens)` is the duck type the detokenizer takes."""
    return hf_reference_tokenizer.backend_tokenizer


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False).ids


def stream(tokenizer, text_or_ids, params: SamplingParams, prompt: str = CHAT_PROMPT):
    ids = encode(tokenizer, text_or_ids) if isinstance(text_or_ids, str) else text_or_ids
    detok = IncrementalDetokenizer(tokenizer, encode(tokenizer, prompt), params)
    updates = []
    for token_id in ids:
        updates.append(detok.append(token_id))
        if updates[-1].stop_string is not None:
            break
    return detok, updates, ids


def deltas(updates) -> list[str]:
    return [u.text_delta for u in updates]


def test_plain_text_streams_token_by_token(tokenizer):
    detok, updates, ids = stream(tokenizer, "The cat sat. The cat ran away.", SamplingParams())
    assert deltas(updates) == ["The", " cat", " sat", ".", " The", " cat", " ran", " away", "."]
    assert detok.flush() == ""
    assert detok.text == tokenizer.decode(ids, skip_special_tokens=True)


def test_emoji_split_across_tokens_is_held_back_until_complete(tokenizer):
    text = "Hello 😀 world 👍🏽"
    ids = encode(tokenizer, text)
    # The tokenizer really splits the emoji: its first token alone decodes to U+FFFD.
    assert "\ufffd" in tokenizer.decode(ids[1:2], skip_special_tokens=True)
    detok, updates, _ = stream(tokenizer, ids, SamplingParams())
    assert deltas(updates)[:4] == ["Hello", "", " 😀", " world"]
    assert all("\ufffd" not in d for d in deltas(updates))
    assert "".join(deltas(updates)) + detok.flush() == text
    assert detok.text == text


@pytest.mark.parametrize("text", ["你好世界，日本語のテキスト", "Ünïcödé ✓ → ∞ 𝔘𝔫𝔦 👨‍👩‍👧 done"])
def test_multibyte_text_never_emits_replacement_char(tokenizer, text):
    detok, updates, ids = stream(tokenizer, text, SamplingParams())
    assert len(ids) > len(text) // 2, "expected characters split into byte tokens"
    assert all("\ufffd" not in d for d in deltas(updates))
    assert detok.flush() == ""
    assert detok.text == text == tokenizer.decode(ids, skip_special_tokens=True)


def test_incomplete_character_at_finish_is_flushed_like_a_full_decode(tokenizer):
    ids = encode(tokenizer, "ok 😀")[:-1]  # cut inside the emoji
    detok, updates, _ = stream(tokenizer, ids, SamplingParams())
    assert "".join(deltas(updates)) == "ok"
    tail = detok.flush()
    assert tail.startswith(" ") and tail.endswith("\ufffd")
    assert detok.text == tokenizer.decode(ids, skip_special_tokens=True)


def test_random_tokens_concatenate_to_full_decode(tokenizer):
    # Arbitrary byte tokens (invalid UTF-8 included) and special tokens, both decode modes.
    rng = random.Random(1234)
    vocab_size = tokenizer.get_vocab_size()
    for skip in (True, False):
        for _ in range(5):
            ids = [rng.randrange(vocab_size) for _ in range(150)] + [IM_END, 216, IM_START]
            rng.shuffle(ids)
            detok, updates, _ = stream(tokenizer, ids, SamplingParams(skip_special_tokens=skip))
            assert "".join(deltas(updates)) + detok.flush() == tokenizer.decode(
                ids, skip_special_tokens=skip
            )


@pytest.mark.parametrize(
    ("stop", "expected_deltas"),
    [
        # The tail of " sat", all of ".", the head of " The": three tokens. The "at" ending
        # " cat" could begin it too, so it is held until " sat" rules it out.
        ("at. Th", ["The", " c", "at s", "", ""]),
        # The tail of " cat", all of " sat" and ".", the head of " The": four tokens.
        ("cat sat. T", ["The", " ", "", "", ""]),
    ],
)
def test_stop_string_spanning_several_tokens(tokenizer, stop, expected_deltas):
    # Tokens: "The", " cat", " sat", ".", " The", ...
    detok, updates, _ = stream(
        tokenizer, "The cat sat. The cat ran away.", SamplingParams(stop=stop)
    )
    assert [u.stop_string for u in updates] == [None] * (len(updates) - 1) + [stop]
    assert deltas(updates) == expected_deltas
    assert detok.text == "".join(expected_deltas)
    assert detok.flush() == ""


def test_stop_string_spanning_two_tokens(tokenizer):
    detok, updates, _ = stream(
        tokenizer, "Answer: 42\n\nQuestion: why", SamplingParams(stop="\n\n")
    )
    assert updates[-1].stop_string == "\n\n"
    assert len(updates) == 7  # "\n" and "\n" are separate tokens
    assert detok.text == "Answer: 42"


def test_false_start_of_stop_string_is_held_then_released(tokenizer):
    params = SamplingParams(stop=["The cat ran"])
    detok, updates, _ = stream(tokenizer, "The cat sat. The cat ran away.", params)
    # "The" and "The cat" could begin the stop string: held until " sat" rules it out.
    assert deltas(updates) == ["", "", "The cat sat", ".", " ", "", ""]
    assert updates[-1].stop_string == "The cat ran"
    assert detok.text == "The cat sat. "


def test_stop_string_at_very_start(tokenizer):
    detok, updates, _ = stream(tokenizer, "STOP at start", SamplingParams(stop=["STOP"]))
    assert updates == [DetokenizerUpdate(text_delta="", stop_string="STOP")]
    assert detok.text == "" and detok.flush() == ""


def test_earliest_occurring_stop_string_wins(tokenizer):
    text = "one two three four five"
    params = SamplingParams(stop=["four", "two thr"])  # listed later, occurs earlier
    detok, updates, _ = stream(tokenizer, text, params)
    assert updates[-1].stop_string == "two thr"
    assert detok.text == "one "
    # Both complete in the same token: still the earlier one in the text wins.
    ids = encode(tokenizer, "a bc")
    detok, updates, _ = stream(tokenizer, ids, SamplingParams(stop=["c", "b"]))
    assert updates[-1].stop_string == "b"
    assert detok.text == "a "


@pytest.mark.parametrize(
    "stop",
    [["ran away"], ["sat. The cat ran", "cat r"], ["y."], ["The cat sat. The cat ran away."]],
)
def test_streamed_text_is_always_a_prefix_of_the_final_text(tokenizer, stop):
    text = "The cat sat. The cat ran away."
    detok, updates, ids = stream(tokenizer, text, SamplingParams(stop=stop))
    final = detok.text
    expected_end = min(text.find(s) for s in stop)
    assert final == text[:expected_end]
    streamed = ""
    for update in updates:
        streamed += update.text_delta
        # Never retracted, so no client ever saw any piece of the stop string.
        assert final.startswith(streamed)
    assert streamed == final


def test_flush_releases_held_back_stop_prefix(tokenizer):
    detok, updates, _ = stream(tokenizer, "hello wor", SamplingParams(stop=["world"]))
    assert "".join(deltas(updates)) == "hello "
    assert detok.flush() == "wor"  # finished for length: the held-back text is real output
    assert detok.text == "hello wor"


def test_skip_special_tokens(tokenizer):
    ids = encode(tokenizer, "Hi there") + [IM_END]
    skipped, _, _ = stream(tokenizer, ids, SamplingParams(skip_special_tokens=True))
    kept, _, _ = stream(tokenizer, ids, SamplingParams(skip_special_tokens=False))
    assert skipped.text + skipped.flush() == "Hi there"
    assert kept.text + kept.flush() == "Hi there<|im_end|>"
    # A stop string can match special-token text only when that text is produced.
    params = SamplingParams(stop=["<|im_end|>"], skip_special_tokens=False)
    stopped, updates, _ = stream(tokenizer, ids, params)
    assert updates[-1].stop_string == "<|im_end|>" and stopped.text == "Hi there"


def test_first_token_is_decoded_in_prompt_context(tokenizer):
    # Even a prompt ending inside a character: output decodes as it would on its own.
    cut_prompt = encode(tokenizer, "Say 😀")[:-1]
    ids = encode(tokenizer, " fine")
    detok = IncrementalDetokenizer(tokenizer, cut_prompt, SamplingParams())
    assert [detok.append(t).text_delta for t in ids] == [" fine"]
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    assert [detok.append(t).text_delta for t in ids] == [" fine"]


class CountingDecoder:
    """The real tokenizer, counting how many token ids each decode is handed."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.max_ids_per_call = 0

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        self.max_ids_per_call = max(self.max_ids_per_call, len(ids))
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def test_per_token_decode_window_does_not_grow_with_output(tokenizer):
    ids = encode(tokenizer, "The quick brown fox jumps over the lazy dog. 你好! " * 60)
    decoder = CountingDecoder(tokenizer)
    detok = IncrementalDetokenizer(decoder, encode(tokenizer, CHAT_PROMPT), SamplingParams())
    for token_id in ids:
        detok.append(token_id)
    assert len(ids) > 600
    assert decoder.max_ids_per_call <= 8
    assert detok.text == tokenizer.decode(ids, skip_special_tokens=True)
