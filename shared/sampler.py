"""Turns one step's logits into one token per row, honouring each request's `SamplingParams`.

Order of processing, and why:

1. Constraints: `logit_bias` is added, then tokens the request's grammar does not allow and
   suppressed tokens (EOS and stop ids before `min_tokens`) -> -inf. Done first so that no
   later step can revive them (every later step keeps -inf at -inf). Where the grammar allows
   only suppressed tokens (it is complete, min_tokens is not reached), the grammar wins.
2. Repetition penalty (Hugging Face semantics, over prompt + output tokens): divide positive
   logits by the penalty, multiply negative ones. It looks at the sign of the logit, so it must
   see the model's own logits, before any additive penalty could push one across zero.
3. Frequency and presence penalties (OpenAI semantics, over output tokens only):
   `logit -= frequency * count + presence * (count > 0)`; defined on logits, so before
   temperature.
4. Greedy rows (temperature 0) take the argmax here: the knobs below do not change it.
5. Divide by temperature, then top-k, top-p, min-p, all on the distribution that is actually
   sampled from (the nucleus of top-p depends on the temperature). top-k before top-p, as in
   Hugging Face and vLLM, so top-p measures mass among the k survivors. min-p compares each
   probability to the largest one; that ratio does not change when top-k/top-p renormalise, so
   its place among the filters does not matter.
6. Draw with the row's own generator (one uniform, inverse transform, see `_draw`), always
   over the vocabulary in token-id order, so a seeded row gives the same token whatever other
   rows share the batch.

Logprobs are taken from the RAW model logits (log_softmax before penalties, temperature and
filters), as vLLM reports them by default: they describe the model, not the sampling knobs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from splitserve.engine.outputs import TokenLogprobs
from splitserve.engine.sampling_params import SamplingParams
from splitserve.kernels import cpu as cpu_kernels


@dataclass
class SamplingRow:
    """One row of the logits: the request it belongs to and what sampling needs of it."""

    params: SamplingParams
    # Per-request RNG on the logits' device, seeded from params.seed by the caller (see
    # `make_generator`); None draws from torch's global RNG.
    generator: torch.Generator | None
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    # Tokens that must not be sampled this step (e.g. EOS / stop ids before min_tokens).
    # Ids outside the vocabulary are ignored: they could never be sampled anyway.
    suppressed_token_ids: tuple[int, ...] = ()
    # Structured outputs: bool [vocab], True where the grammar allows the token; None = free.
    allowed_token_mask: torch.Tensor | None = None

    @property
    def is_constrained(self) -> bool:
        """Whether step 1 changes this row's logits."""
        return bool(
            self.suppressed_token_ids
            or self.allowed_token_mask is not None
            or self.params.logit_bias
        )


@dataclass
class SamplerOutput:
    sampled_token_ids: list[int]  # row -> token id
    logprobs: list[TokenLogprobs | None]  # row -> logprobs, None where not asked for


def make_generator(
    params: SamplingParams, device: torch.device | str = "cpu"
) -> torch.Generator | None:
    """The per-request generator for `SamplingRow.generator`: None when unseeded."""
    if params.seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(params.seed)
    return generator


class Sampler:
    """Stateless; `sample` never mutates the logits it is given."""

    def sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        # logits: [num_rows, vocab_size]
        assert logits.dim() == 2, f"logits must be [num_rows, vocab], got {tuple(logits.shape)}"
        assert logits.shape[0] == len(rows), f"{logits.shape[0]} logit rows for {len(rows)} rows"
        if not rows:
            return SamplerOutput([], [])
        logits = logits.float()
        is_plain = _is_plain_greedy(rows)
        sampled = self._token_ids(logits, rows, is_plain).tolist()
        if is_plain:  # no row asks for logprobs
            return SamplerOutput(sampled, [None] * len(rows))
        return SamplerOutput(sampled, _compute_logprobs(logits, rows, sampled))

    def sample_on_device(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """[num_rows] int64 on the logits' device: the tokens `sample` would return, left
        there unread so the host need not wait for them (async scheduling). No logprobs."""
        assert all(row.params.logprobs is None for row in rows), "logprobs need the host"
        return self._token_ids(logits.float(), rows, _is_plain_greedy(rows))

    @staticmethod
    def _token_ids(
        logits: torch.Tensor, rows: list[SamplingRow], is_plain_greedy: bool
    ) -> torch.Tensor:
        if is_plain_greedy:
            if any(r.is_constrained for r in rows):
                logits = _constrain(logits.clone(), rows)
            return argmax_rows(logits)
        logits = apply_penalties(logits, rows)
        random_rows = [i for i, row in enumerate(rows) if not row.params.is_greedy]
        if len(random_rows) == len(rows):  # no greedy row: no argmax (1.3 ms at 16 x 49k)
            return _sample_random(logits, rows, random_rows)
        token_ids = argmax_rows(logits)  # greedy rows keep this
        if random_rows:
            token_ids[random_rows] = _sample_random(logits, rows, random_rows)
        return token_ids


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Steps 1-3 (constraints, repetition, frequency and presence penalties) on a copy of
    logits [num_rows, vocab]; what greedy rows take the argmax of."""
    logits = _constrain(logits.float().clone(), rows)
    logits = _apply_repetition_penalty(logits, rows)
    return _apply_frequency_presence_penalties(logits, rows)


def sampling_distribution(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """[num_rows, vocab] float32: the distribution `sample` draws each row's token from (steps
    1-5), normalised; greedy rows are one-hot at their argmax. Speculative decoding verifies
    drafts against it (and a draft model proposes from it), so the tokens it keeps follow
    exactly what `sample` would have drawn."""
    logits = apply_penalties(logits, rows)
    probs = torch.zeros_like(logits)
    greedy_rows = [i for i, row in enumerate(rows) if row.params.is_greedy]
    if greedy_rows:
        argmax = logits[greedy_rows].argmax(dim=-1, keepdim=True)
        probs[greedy_rows] = probs[greedy_rows].scatter_(1, argmax, 1.0)
    random_rows = [i for i, row in enumerate(rows) if not row.params.is_greedy]
    if random_rows:
        filtered = _filtered_probs(logits, [rows[i].params for i in random_rows], random_rows)
        probs[random_rows] = filtered / filtered.sum(dim=-1, keepdim=True)
    return probs


def draw(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row of probs [num_rows, vocab] (need not be normalised), each row with its
    own generator: the same draw `sample` makes."""
    return _draw(probs, generators)


def compute_logprobs(
    raw_logits: torch.Tensor, rows: list[SamplingRow], token_ids: list[int]
) -> list[TokenLogprobs | None]:
    """Logprobs of `token_ids` (one per row) under the raw logits, for rows that ask for them."""
    return _compute_logprobs(raw_logits.float(), rows, token_ids)


def _is_plain_greedy(rows: list[SamplingRow]) -> bool:
    return all(
        r.params.is_greedy and not _has_penalty(r.params) and r.params.logprobs is None
        for r in rows
    )


def _has_penalty(params: SamplingParams) -> bool:
    return (
        params.repetition_penalty != 1.0
        or params.frequency_penalty != 0.0
        or params.presence_penalty != 0.0
    )


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax (the first index of its largest value, as `argmax` gives): `max`'s
    indices, which torch's CPU build finds 2.5x faster than `argmax` over a [64, 49152] batch
    of logits (0.9 against 2.2 ms on two cores). Float32 rows on the CPU take our kernel
    (kernels/cpu/step_lookups.cpp: the same indices, NaN first as max gives it), where torch's
    loop over one row of SmolLM2's 49,152 logits took 130 us."""
    module = cpu_kernels.load()
    if (
        module is not None
        and logits.device.type == "cpu"
        and logits.dtype == torch.float32
        and logits.dim() == 2
        and logits.shape[1] > 0
    ):
        return module.argmax_rows(logits.contiguous())
    return logits.max(dim=-1).indices


def _constrain(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    logits = _apply_logit_bias(logits, rows)
    logits = _apply_grammar_masks(logits, rows)
    return _suppress(logits, rows)


def _apply_logit_bias(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    token_lists = [[token_id for token_id, _ in r.params.logit_bias] for r in rows]
    if any(token_lists):
        row_idx, tok_idx = _pair_indices(token_lists, logits.device)
        biases = [bias for r in rows for _, bias in r.params.logit_bias]
        logits[row_idx, tok_idx] += torch.tensor(biases, dtype=logits.dtype, device=logits.device)
    return logits


def _apply_grammar_masks(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    masked: list[int] = []
    masks: list[torch.Tensor] = []
    for i, row in enumerate(rows):
        if row.allowed_token_mask is not None:
            masked.append(i)
            masks.append(row.allowed_token_mask)
    if masked:
        allowed = torch.stack(masks).to(logits.device)
        logits[masked] = logits[masked].masked_fill(~allowed, float("-inf"))
    return logits


def _suppressible(row: SamplingRow, vocab_size: int) -> list[int]:
    """The row's suppressed ids, or none when they are all its grammar still allows."""
    token_ids = [t for t in row.suppressed_token_ids if 0 <= t < vocab_size]
    if token_ids and row.allowed_token_mask is not None:
        rest = row.allowed_token_mask.clone()
        rest[token_ids] = False
        if not bool(rest.any()):
            return []
    return token_ids


def _pair_indices(
    token_lists: list[list[int]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(row indices, token ids) of every (row, token) pair, to index a [rows, vocab] tensor."""
    row_idx = [i for i, tokens in enumerate(token_lists) for _ in tokens]
    tok_idx = [t for tokens in token_lists for t in tokens]
    return (
        torch.tensor(row_idx, dtype=torch.long, device=device),
        torch.tensor(tok_idx, dtype=torch.long, device=device),
    )


def _suppress(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    vocab_size = logits.shape[1]
    token_lists = [_suppressible(r, vocab_size) for r in rows]
    if any(token_lists):
        row_idx, tok_idx = _pair_indices(token_lists, logits.device)
        logits[row_idx, tok_idx] = float("-inf")
    return logits


def _apply_repetition_penalty(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    penalised = [i for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0]
    if not penalised:
        return logits
    # Seen tokens count once, however often they occur: indexing with duplicates is fine here
    # because every write of the same (row, token) writes the same bool.
    token_lists = [rows[i].prompt_token_ids + rows[i].output_token_ids for i in penalised]
    row_idx, tok_idx = _pair_indices(token_lists, logits.device)
    seen = torch.zeros(len(penalised), logits.shape[1], dtype=torch.bool, device=logits.device)
    seen[row_idx, tok_idx] = True
    penalty = _column([rows[i].params.repetition_penalty for i in penalised], logits)
    sub = logits[penalised]  # [num_penalised, vocab]
    scaled = torch.where(sub > 0, sub / penalty, sub * penalty)
    logits[penalised] = torch.where(seen, scaled, sub)
    return logits


def _apply_frequency_presence_penalties(
    logits: torch.Tensor, rows: list[SamplingRow]
) -> torch.Tensor:
    penalised = [
        i
        for i, r in enumerate(rows)
        if r.params.frequency_penalty != 0.0 or r.params.presence_penalty != 0.0
    ]
    if not penalised:
        return logits
    token_lists = [rows[i].output_token_ids for i in penalised]
    row_idx, tok_idx = _pair_indices(token_lists, logits.device)
    counts = torch.zeros(len(penalised), logits.shape[1], dtype=logits.dtype, device=logits.device)
    counts.index_put_(
        (row_idx, tok_idx), torch.ones_like(tok_idx, dtype=logits.dtype), accumulate=True
    )
    freq = _column([rows[i].params.frequency_penalty for i in penalised], logits)
    presence = _column([rows[i].params.presence_penalty for i in penalised], logits)
    logits[penalised] -= freq * counts + presence * (counts > 0).to(logits.dtype)
    return logits


def _column(values: list[float], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=like.dtype, device=like.device).unsqueeze(1)


def _sample_random(
    logits: torch.Tensor, rows: list[SamplingRow], random_rows: list[int]
) -> torch.Tensor:
    params = [rows[i].params for i in random_rows]
    probs = _filtered_probs(logits, params, random_rows)
    return _draw(probs, [rows[i].generator for i in random_rows])


def _filtered_probs(
    logits: torch.Tensor, params: list[SamplingParams], random_rows: list[int]
) -> torch.Tensor:
    """Step 5 for the random rows: [num_random, vocab] probabilities, zero where filtered (not
    renormalised after min-p)."""
    # Every row random (the usual batch): divide the logits as they are, without first copying
    # the rows out (0.65 ms at 16 x 49k); the division makes the new tensor either way.
    rows = logits if len(random_rows) == logits.shape[0] else logits[random_rows]
    sub = rows / _column([p.temperature for p in params], logits)
    if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
        sub = _apply_top_k_top_p(sub, params)
    probs = torch.softmax(sub, dim=-1)  # [num_random, vocab]
    if any(p.min_p > 0.0 for p in params):
        probs = _apply_min_p(probs, params)
    return probs


def _apply_top_k_top_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Sets filtered tokens to -inf; rows that ask for neither come back bit for bit unchanged,
    so a row's result does not depend on whether its batch needed this step."""
    vocab_size = logits.shape[1]
    # Stable sort: ties keep token-id order, so the kept set never depends on the batch.
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True, stable=True)
    positions = torch.arange(vocab_size, device=logits.device).unsqueeze(0)
    top_k = torch.tensor(
        [p.top_k if p.top_k > 0 else vocab_size for p in params], device=logits.device
    ).unsqueeze(1)
    remove = positions >= top_k
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))

    top_p = _column([p.top_p for p in params], logits)
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    # Keep the smallest prefix whose mass reaches top_p: drop a token once the tokens before it
    # already reach it. Rows with top_p == 1 skip this, since float round-off in the cumsum
    # could otherwise drop their tail; position 0 is always kept.
    remove_p = (mass_before >= top_p) & (top_p < 1.0)
    remove_p[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(remove_p, float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_idx, sorted_logits)


def _apply_min_p(probs: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    min_p = _column([p.min_p for p in params], probs)
    threshold = min_p * probs.max(dim=-1, keepdim=True).values
    # The most likely token is never below its own threshold (min_p <= 1), so one survives.
    return probs.masked_fill(probs < threshold, 0.0)


def _draw(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row, P(token) proportional to probs (which need not sum to 1).

    Inverse transform: one uniform u per row, from the row's own generator, and the token is
    the first whose running sum of probabilities passes u x the row's total. One random number
    a row, where an exponential race (argmax p_i / E_i) drew one per vocabulary entry: 33 ms of
    a 16-row step over SmolLM2's 49k tokens on two cores, against 1.4 ms here (the running
    sum and the search). The running sum is float64: 49k additions move a token's share by
    at most ~5e-12 of the total (n x the float64 epsilon). A token of probability 0 is never
    drawn, and a seeded row's token depends only on its seed and its own probabilities,
    whatever other rows share the batch.
    """
    cumulative = probs.cumsum(dim=-1, dtype=torch.float64)
    totals = cumulative[:, -1]
    # u x total can round up to the total itself; the largest double below it still falls in
    # the last token with any mass.
    targets = torch.minimum(
        _row_uniforms(generators, probs.device) * totals,
        torch.nextafter(totals, torch.zeros_like(totals)),
    )
    token_ids = torch.searchsorted(cumulative, targets.unsqueeze(1), right=True).squeeze(1)
    # A row without finite positive mass (NaN from logits divided by a tiny temperature, all
    # zero) finds no token: the last one keeps the id in the vocabulary, as the next step's
    # embedding lookup needs, without a device sync to test for it.
    return token_ids.clamp_(max=probs.shape[1] - 1)


def _row_uniforms(generators: list[torch.Generator | None], device: torch.device) -> torch.Tensor:
    """[rows] float64 in [0, 1): each seeded row's from its generator (`_uniform`), the others'
    from torch's global RNG in one call."""
    uniforms = torch.empty(len(generators), dtype=torch.float64, device=device)
    unseeded = [i for i, generator in enumerate(generators) if generator is None]
    if unseeded:
        uniforms[unseeded] = torch.rand(len(unseeded), dtype=torch.float64, device=device)
    for i, generator in enumerate(generators):
        if generator is not None:
            uniforms[i] = _uniform(generator)
    return uniforms


def _uniform(generator: torch.Generator) -> torch.Tensor:
    """What one draw of a seeded row takes from its generator (`advance_generator` repeats it)."""
    return torch.rand((), dtype=torch.float64, generator=generator, device=generator.device)


def advance_generator(generator: torch.Generator, num_draws: int) -> None:
    """Consumes exactly the random numbers `num_draws` tokens sampled by `_draw` would.

    A decode pod continuing a request whose first token a prefill pod sampled with the same
    seed skips that draw, so the sequence equals what one engine would have produced.
    """
    for _ in range(num_draws):
        _uniform(generator)


def _compute_logprobs(
    raw_logits: torch.Tensor, rows: list[SamplingRow], sampled: list[int]
) -> list[TokenLogprobs | None]:
    wanted = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    result: list[TokenLogprobs | None] = [None] * len(rows)
    if not wanted:
        return result
    logprobs = torch.log_softmax(raw_logits[wanted], dim=-1)  # [num_wanted, vocab]
    token_ids = torch.tensor([sampled[i] for i in wanted], device=raw_logits.device)
    token_logprobs = logprobs.gather(1, token_ids.unsqueeze(1))  # [num_wanted, 1]
    ranks = (logprobs > token_logprobs).sum(dim=-1) + 1
    max_top = max(rows[i].params.logprobs or 0 for i in wanted)
    top_values, top_ids = logprobs.topk(max_top, dim=-1)  # sorted, most likely first
    top_value_rows, top_id_rows = top_values.tolist(), top_ids.tolist()
    for j, i in enumerate(wanted):
        num_top = rows[i].params.logprobs or 0
        result[i] = TokenLogprobs(
            token_id=sampled[i],
            logprob=float(token_logprobs[j, 0]),
            rank=int(ranks[j]),
            top=list(zip(top_id_rows[j][:num_top], top_value_rows[j][:num_top])),
        )
    return result
