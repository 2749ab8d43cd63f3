"""Turns a request's output tokens into streamed text, one token at a time, and finds stop strings.

Two hold-backs keep a streaming client from ever seeing text it would have to take back:

* Incomplete characters. A byte-level tokenizer may split one UTF-8 character (an emoji, a CJK
  ideograph) across tokens; decoding the first part alone yields U+FFFD. Text is decoded over a
  small window of tokens and only released once the window no longer ends in U+FFFD:

      | ... emitted ... | prefix window | new, unconfirmed tokens |
                  prefix_offset     read_offset           len(token_ids)

  `decode(window) - decode(prefix)` is the new text; decoding the prefix alongside gives the new
  tokens their context (a leading space that a tokenizer strips at the start of a decode). When
  text is released, both offsets move forward, so the per-token cost depends on the window,
  not on the output length.
* Possible stop strings. Decoded text whose tail could still grow into a stop string stays
  pending until it either completes one (the text is cut before it and generation stops) or can
  no longer (it is released).

The first window starts on the last few prompt tokens, as vLLM does, so the first output token
is decoded in context. For byte-level tokenizers (SmolLM2, Llama 3, ...) the final text equals
`tokenizer.decode(output_token_ids)`; for SentencePiece ones it keeps the leading space of the
first token that a standalone decode would strip.

No torch here: the gateway streams text too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from splitserve.engine.sampling_params import SamplingParams

# Prompt tokens decoded as context before the first output token.
_NUM_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool) -> str: ...


@dataclass(frozen=True)
class DetokenizerUpdate:
    text_delta: str  # newly released text, possibly ""
    stop_string: str | None  # the stop string that ended generation, if one did now


class IncrementalDetokenizer:
    """One per request (per sequence when n > 1). Not thread-safe; the caller owns it.

    After `append` reports a stop string, the request is finished: `append` must not be called
    again and `flush` returns "".
    """

    def __init__(
        self, tokenizer: Decoder, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = params.skip_special_tokens
        self._stop_strings = params.stop
        # Only the window is kept in memory: the prompt tail, then output tokens not yet released.
        self._token_ids = self._prompt_context(prompt_token_ids)
        self._prefix_offset = 0
        self._read_offset = len(self._token_ids)
        # Decoded text held back because it could be the start of a stop string.
        self._pending = ""
        self._emitted: list[str] = []
        self.stop_string: str | None = None

    @property
    def text(self) -> str:
        """All text released so far (deltas and flush), never including a stop string."""
        if len(self._emitted) > 1:
            self._emitted = ["".join(self._emitted)]
        return self._emitted[0] if self._emitted else ""

    @property
    def is_stopped(self) -> bool:
        return self.stop_string is not None

    def append(self, token_id: int) -> DetokenizerUpdate:
        """Takes the next output token; returns the text it releases and any stop string hit."""
        assert not self.is_stopped, "append after a stop string: the request is finished"
        self._token_ids.append(token_id)
        self._pending += self._decode_new_text()
        if self._stop_strings:
            delta = self._release_checking_stops()
        else:
            delta, self._pending = self._pending, ""
        if delta:
            self._emitted.append(delta)
        return DetokenizerUpdate(text_delta=delta, stop_string=self.stop_string)

    def flush(self) -> str:
        """Releases everything held back, for a request finishing for another reason (length,
        EOS, abort). Unfinished characters come out as U+FFFD, as a full decode would give them;
        stop strings are not looked for in this last piece."""
        if self.is_stopped:
            return ""
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        tail = self._decode(self._prefix_offset, len(self._token_ids))[len(prefix_text) :]
        delta = self._pending + tail
        self._pending = ""
        self._prefix_offset = self._read_offset = len(self._token_ids)
        if delta:
            self._emitted.append(delta)
        return delta

    def _prompt_context(self, prompt_token_ids: list[int]) -> list[int]:
        context = list(prompt_token_ids[-_NUM_PROMPT_CONTEXT_TOKENS:])
        # A prompt cut inside a character would make the first output bytes merge with its
        # tail; decode the output on its own then, as a full decode of it would.
        if self._decode_ids(context).endswith(_REPLACEMENT_CHAR):
            return []
        return context

    def _decode(self, start: int, end: int) -> str:
        return self._decode_ids(self._token_ids[start:end])

    def _decode_ids(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _decode_new_text(self) -> str:
        """Text the unconfirmed tokens add, or "" while they end inside a character."""
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        full_text = self._decode(self._prefix_offset, len(self._token_ids))
        if full_text.endswith(_REPLACEMENT_CHAR):
            return ""
        if len(full_text) <= len(prefix_text):
            # The new tokens add no text (e.g. a skipped special token): confirm them, but keep
            # the prefix so the next token still has context.
            self._read_offset = len(self._token_ids)
            return ""
        self._drop_released_tokens()
        return full_text[len(prefix_text) :]

    def _drop_released_tokens(self) -> None:
        # The unconfirmed tokens become the next prefix; everything before it is done with.
        del self._token_ids[: self._read_offset]
        self._prefix_offset = 0
        self._read_offset = len(self._token_ids)

    def _release_checking_stops(self) -> str:
        """Cuts pending text at the earliest stop string, or releases all of it but the longest
        tail that could still become one.

        Invariant: no stop string can start in released text, so searching `_pending` alone
        finds every stop string, at a cost bounded by the longest stop string plus one token.
        """
        found = _earliest_stop(self._pending, self._stop_strings)
        if found is not None:
            start, self.stop_string = found
            delta, self._pending = self._pending[:start], ""
            return delta
        keep = _longest_stop_prefix_suffix(self._pending, self._stop_strings)
        cut = len(self._pending) - keep
        delta, self._pending = self._pending[:cut], self._pending[cut:]
        return delta


def _earliest_stop(text: str, stop_strings: tuple[str, ...]) -> tuple[int, str] | None:
    """(start, stop string) of the stop string occurring first in text; at equal starts, the one
    listed first."""
    best: tuple[int, str] | None = None
    for stop in stop_strings:
        start = text.find(stop)
        if start >= 0 and (best is None or start < best[0]):
            best = (start, stop)
    return best


def _longest_stop_prefix_suffix(text: str, stop_strings: tuple[str, ...]) -> int:
    """Length of the longest tail of text that is a proper prefix of some stop string."""
    longest = 0
    for stop in stop_strings:
        for length in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:length]):
                longest = length
                break
    return longest
