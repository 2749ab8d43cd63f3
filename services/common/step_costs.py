"""`StepCosts`: what one engine step costs on a pod, as the pod measured it, and how much it can
take at once. The contract between the pods (which fit it to their own steps) and the
gateway's admission control (services/gateway/admission/), which predicts a request's time to
first token and time per output token on each pod from it.

    one step's milliseconds ~= base_ms + row_ms * decode rows + prefill_token_ms * prompt tokens

A pod that has not yet run enough steps to fit the line reports zeros (`is_known` False): the
gateway then refuses nothing on a prediction it cannot make. The field names are the
`WorkerStats` proto's, so the conversion walks the fields. Torch-free: the gateway imports it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from splitserve.v1 import worker_pb2


@dataclass(frozen=True)
class StepCosts:
    step_base_ms: float = 0.0  # a step's fixed cost (weights read once, scheduling, sampling)
    step_row_ms: float = 0.0  # each decode row (a running request's next token)
    step_prefill_token_ms: float = 0.0  # each prompt token computed in the step
    max_num_seqs: int = 0  # rows the pod runs at most in one step (0: not reported)
    max_num_batched_tokens: int = 0  # tokens it computes at most in one step (0: not reported)

    @property
    def is_known(self) -> bool:
        """The pod has fitted its costs (before that, every cost is 0)."""
        return self.step_base_ms > 0 or self.step_row_ms > 0 or self.step_prefill_token_ms > 0

    def step_ms(self, num_rows: int, num_prefill_tokens: int = 0) -> float:
        """One step with `num_rows` decode rows and `num_prefill_tokens` prompt tokens."""
        return (
            self.step_base_ms
            + self.step_row_ms * num_rows
            + self.step_prefill_token_ms * num_prefill_tokens
        )

    @classmethod
    def from_proto(cls, stats: worker_pb2.WorkerStats) -> StepCosts:
        return cls(**{name: getattr(stats, name) for name in FIELD_NAMES})

    def as_fields(self) -> dict[str, float | int]:
        """Field name -> value: the `WorkerStats` keywords."""
        return dataclasses.asdict(self)


FIELD_NAMES = tuple(field.name for field in dataclasses.fields(StepCosts))
