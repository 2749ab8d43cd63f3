"""How long a request's prompt should stay cached, from the API's fields: OpenAI's
`prompt_cache_retention` ("in_memory": the engine's own window; "24h") and Anthropic-style
`cache_control: {"type": "ephemeral", "ttl": "5m" | "1h"}` on messages or their content parts.
The longest window asked for wins; it becomes `SamplingParams.cache_retention_s`, which the
decode pod's eviction policy honours (and bounds by its `max_retention_s`: above it is a 400).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from splitserve.gateway.errors import RequestError
from splitserve.gateway.strict_model import StrictModel

RETENTIONS: dict[str, float | None] = {"in_memory": None, "24h": 86400.0}
CACHE_CONTROL_TTLS = {"5m": 300.0, "1h": 3600.0}


class CacheControl(StrictModel):
    """Anthropic's prompt-caching marker: keep this prompt's cached blocks for the ttl."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


def cache_retention_s(
    prompt_cache_retention: object, cache_controls: Sequence[CacheControl | None] = ()
) -> float | None:
    """The window in seconds (from the retention field and the `cache_control` markers of the
    messages and their parts), or None for the engine's default. Raises RequestError (400)."""
    windows = [_from_retention(prompt_cache_retention)]
    windows += [CACHE_CONTROL_TTLS[marker.ttl or "5m"] for marker in cache_controls if marker]
    asked = [window for window in windows if window is not None]
    return max(asked) if asked else None


def _from_retention(value: object) -> float | None:
    if value is None:
        return None
    if value not in RETENTIONS:
        raise RequestError(
            f"prompt_cache_retention must be one of {', '.join(RETENTIONS)}, got {value!r}",
            "prompt_cache_retention",
        )
    return RETENTIONS[value]
