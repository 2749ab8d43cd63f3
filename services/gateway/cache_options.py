"""How long a request's prompt should stay cached, from the API's fields: OpenAI's
`prompt_cache_retention` ("in_memory": the engine's own window; "24h") and Anthropic-style
`cache_control: {"type": "ephemeral", "ttl": "5m" | "1h"}` on messages or their content parts.
The longest window asked for wins; it becomes `SamplingParams.cache_retention_s`, which the
decode pod's eviction policy honours (and bounds by its `max_retention_s`: above it is a 400).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from services.gateway.api_errors import RequestError

RETENTIONS: dict[str, float | None] = {"in_memory": None, "24h": 86400.0}
CACHE_CONTROL_TTLS = {"5m": 300.0, "1h": 3600.0}


def cache_retention_s(
    prompt_cache_retention: object, messages: Sequence[Mapping] = ()
) -> float | None:
    """The window in seconds, or None for the engine's default. Raises RequestError (400)."""
    windows = [_from_retention(prompt_cache_retention)]
    for i, message in enumerate(messages):
        windows.append(_from_cache_control(message.get("cache_control"), f"messages[{i}]"))
        content = message.get("content")
        if isinstance(content, list):
            for j, part in enumerate(content):
                if isinstance(part, Mapping):
                    param = f"messages[{i}].content[{j}]"
                    windows.append(_from_cache_control(part.get("cache_control"), param))
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


def _from_cache_control(value: object, param: str) -> float | None:
    if value is None:
        return None
    if not isinstance(value, Mapping) or value.get("type") != "ephemeral":
        raise RequestError(
            f'{param}.cache_control must be {{"type": "ephemeral", "ttl": "5m" | "1h"}}',
            f"{param}.cache_control",
        )
    ttl = value.get("ttl", "5m")
    if ttl not in CACHE_CONTROL_TTLS or set(value) - {"type", "ttl"}:
        raise RequestError(
            f"{param}.cache_control.ttl must be one of {', '.join(CACHE_CONTROL_TTLS)}, "
            f"got {ttl!r}",
            f"{param}.cache_control",
        )
    return CACHE_CONTROL_TTLS[ttl]
