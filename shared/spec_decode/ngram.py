"""N-gram prompt lookup: propose what followed the last occurrence of the newest n tokens.

Text that copies from its context (rewriting code, quoting a document, repeating a list's
structure) makes the tokens after an earlier occurrence of the current suffix a good guess, at
no model cost. Longer n-grams are tried first (fewer, better matches); the latest earlier
occurrence wins, since recent text predicts best what comes next.
"""

from __future__ import annotations

from splitserve.engine.step import Drafts, ScheduledChunk

# The n-gram sizes tried, longest first.
MAX_NGRAM = 4
MIN_NGRAM = 2
# Only the newest tokens are searched: keeps a step's lookup cost bounded on long contexts.
MAX_SEARCH_TOKENS = 4096


def propose_ngram(
    token_ids: list[int],
    num_draft_tokens: int,
    max_ngram: int = MAX_NGRAM,
    min_ngram: int = MIN_NGRAM,
) -> list[int]:
    """Up to `num_draft_tokens` tokens that followed the latest earlier occurrence of the
    longest suffix of `token_ids` (max_ngram down to min_ngram tokens); [] when none recurs."""
    if num_draft_tokens <= 0:
        return []
    tokens = token_ids[-MAX_SEARCH_TOKENS:]
    for n in range(min(max_ngram, len(tokens) - 1), min_ngram - 1, -1):
        start = _latest_earlier_match(tokens, n)
        if start is not None:
            follow = start + n
            return tokens[follow : follow + num_draft_tokens]
    return []


def _latest_earlier_match(tokens: list[int], n: int) -> int | None:
    """The start of the latest occurrence of tokens[-n:] that ends before the suffix itself."""
    suffix = tokens[-n:]
    last = suffix[-1]
    # Scan candidate end positions right to left; comparing the last token first skips most.
    for end in range(len(tokens) - 2, n - 2, -1):
        if tokens[end] == last and tokens[end - n + 1 : end + 1] == suffix:
            return end - n + 1
    return None


class NgramProposer:
    """Fills each chunk's draft slots from its own request's tokens (no model, no state)."""

    def propose(self, chunks: list[ScheduledChunk]) -> dict[str, Drafts]:
        drafts = {}
        for chunk in chunks:
            token_ids = propose_ngram(chunk.request.all_token_ids, chunk.num_draft_slots)
            if token_ids:
                drafts[chunk.request.request_id] = Drafts(token_ids)
        return drafts
