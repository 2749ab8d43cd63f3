"""The documented maxima of a request (docs/api.md, "Request bounds"), each a 400 past it, and
the chat roles a conversation may use. The body's size and encoding are checked before any
route runs (services/gateway/auth/http.py); these are checked where the request core and the
tool hooks read the fields, so HTTP and gRPC refuse alike."""

from __future__ import annotations

from collections.abc import Sequence, Sized

from splitserve.engine.sampling_params import SamplingParams
from splitserve.gateway.errors import RequestError

MAX_MESSAGES = 4096
MAX_TOOLS = 128  # OpenAI's own limit
MAX_STOP = 16
MAX_LOGIT_BIAS = 1024
# |priority| at most this: the pods take an int32, and admission control sends them twice the
# client's priority plus one (admission/controller.py's pod_priority).
MAX_PRIORITY = 2**29
# OpenAI's roles ("developer" is the newer "system"; "function" the deprecated "tool").
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})


def check_count(name: str, items: object, maximum: int) -> None:
    if isinstance(items, Sized) and not isinstance(items, str) and len(items) > maximum:
        raise RequestError(
            f"{name} has {len(items)} entries; this server takes at most {maximum}",
            name,
            "too_many_entries",
        )


def check_params_bounds(params: SamplingParams) -> None:
    check_count("stop", params.stop, MAX_STOP)
    check_count("logit_bias", params.logit_bias, MAX_LOGIT_BIAS)


def check_priority(priority: int) -> None:
    if not -MAX_PRIORITY <= priority <= MAX_PRIORITY:
        raise RequestError(
            f"priority must be between {-MAX_PRIORITY} and {MAX_PRIORITY}, got {priority}",
            "priority",
        )


def check_conversation(messages: Sequence[dict[str, str]]) -> None:
    """At most MAX_MESSAGES messages, each of a known role."""
    check_count("messages", messages, MAX_MESSAGES)
    for index, message in enumerate(messages):
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise RequestError(
                f"messages[{index}].role must be one of {', '.join(sorted(CHAT_ROLES))}; "
                f"got {role!r}",
                f"messages[{index}].role",
            )
