"""A step on the device whose sampled tokens the host has not read yet (async scheduling).

The runner's `launch` returns one: the forward and the sampling are queued on the device, the
tokens stay there (the next step's decode rows read them as their inputs) and a copy to pinned
host memory is queued behind them. `token_ids()` waits for that copy only, so the host can
schedule and launch the next step first (shared/overlap.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from splitserve.engine.step import SchedulerOutput


@dataclass
class LaunchedStep:
    sched: SchedulerOutput
    request_ids: list[str]  # one per sampled row, in row order
    device_token_ids: torch.Tensor  # [rows] int64 on the device
    host_token_ids: torch.Tensor  # [rows] int64 on the host (pinned on CUDA), filled async
    ready: torch.cuda.Event | None  # recorded after the copy; None where it is synchronous
    start_time: float = field(default_factory=time.monotonic)

    @classmethod
    def queue(
        cls, sched: SchedulerOutput, request_ids: list[str], device_token_ids: torch.Tensor
    ) -> LaunchedStep:
        """Queues the tokens' copy to the host behind the step's kernels."""
        if device_token_ids.device.type != "cuda":
            return cls(sched, request_ids, device_token_ids, device_token_ids, None)
        host = torch.empty(device_token_ids.shape, dtype=torch.int64, pin_memory=True)
        host.copy_(device_token_ids, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return cls(sched, request_ids, device_token_ids, host, ready)

    def row_of(self) -> dict[str, int]:
        """request id -> its row in device_token_ids."""
        return {request_id: row for row, request_id in enumerate(self.request_ids)}

    def token_ids(self) -> list[int]:
        """The sampled tokens, waiting for the step (and only this step) to finish."""
        if self.ready is not None:
            self.ready.synchronize()
        return self.host_token_ids.tolist()
