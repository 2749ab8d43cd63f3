"""How long a request's prompt should stay cached, from the API's fields: OpenAI's
`prompt_cache_retention` ("in_memory": the engine's own window; "24h") and Anthropic-style
`cache_control: {"type": "ephemeral", "ttl": "5m" | "1h"}` on messages or their content parts.
The longest window asked for wins; it becomes `SamplingParams.cache_retention_s`, which the
decode pod's eviction policy honours (and bounds by its `max_retention_s`: above it is a 400).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from splitserve.gateway.api_errors import RequestError

RETENTIONS: dict[str, float | None] = {"in_memory": None, "24h": 86400.0}
CACHE_CONTROL_TTLS = {"5m": 300.0, "1h": 3600.0}


def cache_retention_s(
    prompt_cache_retention: object, messages: Sequence[Mapping] = ()
) -> float | None:
    """The window in seconds, or None for the engine's default. Raises RequestError (400)."""
    windows = [_from_retention(prompt_cache_retention)]
    for message in messages:
        windows.append(_from_cache_control(message.get("cache_control")))
        content = message.get("content")
        if isinstance(content, list):
            windows += [_from_cache_control(part.get("cache_control")) for part in content]
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
    return RETENTIONS[value]  # type: ignore[index]


def _from_cache_control(value: object) -> float | None:
    """The window of a `cache_control` marker, whose shape the body model (api_schema's
    CacheControl) has already checked."""
    if value is None:
        return None
    return CACHE_CONTROL_TTLS[value.get("ttl") or "5m"]  # type: ignore[union-attr]
