"""Decode pods that die in a simulation, and the streams that move off them.

What the gateway does (services/gateway/migration.py), replayed on token counts: when a decode
pod dies, its streams break. The gateway notices at once when the connection resets (a killed
pod: `detect_s` 0) or after its stall timeout when the pod wedges (`detect_s` = that timeout),
then sends each broken sequence to another decode pod with the tokens delivered so far, where
it is prefilled again from scratch (prompt + delivered tokens, less what that pod's prefix cache
holds) and goes on. A request that had no output yet is sent again the same way. A sequence
longer than `max_replay_tokens` is not replayed and ends with an error, as on the gateway; so
does everything when no decode pod is left. New arrivals route around the dead pod at once
(the registry drops it).

The cost shows up where clients feel it: one long inter-token gap (the outage plus the
re-prefill) in each moved stream, and the extra prefill work on the pods that take them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DEFAULT_MAX_REPLAY_TOKENS = 8192  # the gateway's MigrationPolicy default


@dataclass(frozen=True)
class PodFailure:
    at_s: float  # when the pod dies
    decode_pod: int  # which decode pod, by index
    detect_s: float = 0.0  # until the gateway sees its streams broken
    max_replay_tokens: int = DEFAULT_MAX_REPLAY_TOKENS

    def __post_init__(self) -> None:
        if not (math.isfinite(self.at_s) and self.at_s >= 0):
            raise ValueError(f"a pod failure's time must be >= 0 seconds, got {self.at_s}")
        if self.decode_pod < 0 or self.detect_s < 0 or self.max_replay_tokens < 1:
            raise ValueError(
                "a pod failure needs decode_pod >= 0, detect_s >= 0 and max_replay_tokens >= 1"
            )

    @property
    def pod_name(self) -> str:
        return f"decode-{self.decode_pod}"
