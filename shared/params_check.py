"""The checks of a `SamplingParams` that need more than its own values: the model's vocabulary
and the grammar engine. One function, run by the engine as a request is added and by the
gateway before anything is scheduled, so both refuse the same input with the same message.
Torch-free: the gateway imports it."""

from __future__ import annotations

from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.structured_output.grammar import grammar_for


def check_params(params: object, vocab_size: int) -> None:
    """SamplingParams checks its own values; what depends on the model is checked here (and a
    front end may still pass something else). Raises ValueError whose message starts with the
    parameter's name; a structured output that does not compile raises GrammarError."""
    if not isinstance(params, SamplingParams):
        raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
    too_large = [token_id for token_id, _ in params.logit_bias if token_id >= vocab_size]
    if too_large:
        raise ValueError(
            f"logit_bias token ids must be below the vocabulary size {vocab_size}, "
            f"got {too_large[0]}"
        )
    if params.structured_output is not None:
        grammar_for(params.structured_output)  # compiled once per spec text (cached)
