"""Verification of draft tokens against the target's distribution, for a batch of requests.

For each request the target scored k + 1 positions in one forward: row j is the target's
distribution p_j for the token after draft j (row 0: after the newest real token). Drafts are
judged in order:

- greedy: draft j is accepted while it equals argmax p_j; the first mismatch is replaced by
  that argmax, and if all k agree argmax p_k is the bonus token.
- sampling: draft j (drawn from the proposer's q_j) is accepted with probability
  min(1, p_j(d) / q_j(d)); on rejection the token is drawn from max(0, p_j - q_j) normalised,
  and the run ends. If all k are accepted a bonus token is drawn from p_k. Each emitted token
  is then distributed exactly as p (Leviathan et al. 2023, Chen et al. 2023). A deterministic
  proposer (n-gram) is the point mass q_j = 1 at its draft: acceptance is p_j(d) and the
  residual is p_j with the draft's entry removed.

p_j is `sampling_distribution` of the request's own SamplingParams at that position
(penalties, temperature, top-k, top-p, min-p), so what comes out equals what plain sampling
would give in distribution.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from splitserve.engine.sampler import SamplingRow, draw, sampling_distribution


@dataclass
class Verification:
    """One request's drafts and what the target computed for them."""

    draft_token_ids: list[int]  # k drafts
    # [k, vocab] the proposer's distributions the drafts were drawn from; None = point masses.
    draft_probs: torch.Tensor | None
    rows: list[SamplingRow]  # k + 1: row j samples the token after draft j
    generator: torch.Generator | None  # the request's RNG (None: torch's global RNG)


def verify(logits: torch.Tensor, batch: list[Verification]) -> list[list[int]]:
    """logits [sum(k_i + 1), vocab], each request's rows in batch order. Returns per request
    the accepted drafts followed by one token the target chose."""
    rows = [row for item in batch for row in item.rows]
    assert logits.shape[0] == len(rows), f"{logits.shape[0]} logit rows for {len(rows)} rows"
    if _is_plain_greedy(rows):
        targets = logits.argmax(dim=-1).tolist()
        return _split_greedy(targets, batch)
    probs = sampling_distribution(logits, rows)  # [num_rows, vocab]
    results = []
    start = 0
    for item in batch:
        num_rows = len(item.rows)
        results.append(_verify_one(probs[start : start + num_rows], item))
        start += num_rows
    return results


def _is_plain_greedy(rows: list[SamplingRow]) -> bool:
    return all(
        r.params.is_greedy
        and not r.is_constrained
        and r.params.repetition_penalty == 1.0
        and r.params.frequency_penalty == 0.0
        and r.params.presence_penalty == 0.0
        for r in rows
    )


def _split_greedy(targets: list[int], batch: list[Verification]) -> list[list[int]]:
    results = []
    start = 0
    for item in batch:
        results.append(accept_greedy(item.draft_token_ids, targets[start : start + len(item.rows)]))
        start += len(item.rows)
    return results


def accept_greedy(draft_token_ids: list[int], target_token_ids: list[int]) -> list[int]:
    """The longest prefix of the drafts that the target agrees with, plus the target's token
    after it (len(target_token_ids) == len(draft_token_ids) + 1)."""
    accepted = []
    for draft, target in zip(draft_token_ids, target_token_ids):
        if draft != target:
            break
        accepted.append(draft)
    return accepted + [target_token_ids[len(accepted)]]


def _verify_one(probs: torch.Tensor, item: Verification) -> list[int]:
    """probs [k + 1, vocab], normalised."""
    if item.rows[0].params.is_greedy:
        return accept_greedy(item.draft_token_ids, probs.argmax(dim=-1).tolist())
    accepted: list[int] = []
    for j, draft in enumerate(item.draft_token_ids):
        p = probs[j]
        q_draft = 1.0 if item.draft_probs is None else float(item.draft_probs[j, draft])
        u = float(torch.rand((), generator=item.generator, device=probs.device))
        if u * q_draft < float(p[draft]):
            accepted.append(draft)
            continue
        return accepted + [_draw_residual(p, item, j, draft)]
    bonus = draw(probs[len(accepted)].unsqueeze(0), [item.generator])
    return accepted + [int(bonus[0])]


def _draw_residual(p: torch.Tensor, item: Verification, j: int, draft: int) -> int:
    """A token from max(0, p - q) normalised: what p holds that the proposer over-sampled."""
    if item.draft_probs is None:
        residual = p.clone()
        residual[draft] = 0.0
    else:
        residual = (p - item.draft_probs[j].to(p.dtype)).clamp_(min=0.0)
    if float(residual.sum()) <= 0.0:
        # Only reachable through round-off (a rejection needs p(d) < q(d), so some p > q).
        residual = p
    return int(draw(residual.unsqueeze(0), [item.generator])[0])
