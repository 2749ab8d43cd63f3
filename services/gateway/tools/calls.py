"""A choice's generated text read back as content and tool calls, as it arrives: the same
parser serves streams (each chunk's delta) and whole answers (one feed, then `finish`), so a
streamed answer reassembles to exactly the non-streamed one.

How an answer is read (tool_choice other than "none"):
- After optional leading whitespace, a `{` or `[` starts calls (`scan.py`). A call is
  committed, and streamed, once its name is a known tool and its arguments object has
  started: first `{index, id, type, function: {name, arguments}}`, then fragments of the
  arguments' text with only `index` and `function.arguments`. A call object closed without
  arguments gets `{}`. Text after the calls is ignored; with `parallel_tool_calls` false only
  the first call counts. JSON that is no call (an unknown name, no name, a key other than
  "name" and "arguments", arguments that are not an object, broken syntax) before any call
  was committed makes the whole answer content.
- Any other answer is content, streamed as it comes. Unless the output is constrained
  (required, named, or auto with a strict tool), calls may also follow the text in
  `<tool_call>...</tool_call>` tags or ```` ```json ```` fences: the text before the first
  tag or fence is the content, the rest is held back until the end and must be nothing but
  such blocks holding calls, else it is content too. Partial tags are held back meanwhile.
- Content that is only whitespace before calls is null.
A call's `id` is `call_` and 24 random hex digits.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from splitserve.gateway.tools.request import ToolRequest
from splitserve.gateway.tools.scan import CALL_KEYS, CallScanner, ScannedCall

_MARKERS = {"<tool_call>": "</tool_call>", "```json": "```"}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolDelta:
    """What the text read so far adds to the choice: content, and tool-call delta entries in
    OpenAI's stream shape."""

    content: str = ""
    tool_calls: list[dict] = field(default_factory=list)

    def extend(self, other: ToolDelta) -> ToolDelta:
        self.content += other.content
        self.tool_calls.extend(other.tool_calls)
        return self


@dataclass
class _Committed:
    index: int
    scanned: ScannedCall | None  # None for a call read whole from a tag or fence
    # Text index up to which the arguments went out (a call without arguments: 1 once "{}"
    # went out).
    args_sent: int = 0


class ToolCallParser:
    """One choice's text; `feed` each piece, then `finish` once. Not thread-safe."""

    def __init__(self, request: ToolRequest) -> None:
        self.request = request
        self._text = ""
        self._mode = "start"  # start, text, calls, marked
        self._sent = 0  # content sent up to this text index
        self._scanner: CallScanner | None = None
        self._committed: list[_Committed] = []
        self._marked_start = 0
        self._names = {tool.name for tool in request.callable_tools}
        # Constrained answers are calls or plain text: a call in a tag would not be enforced.
        self._reads_markers = request.choice == "auto" and not request.is_strict_auto

    @property
    def has_calls(self) -> bool:
        return bool(self._committed)

    def feed(self, text: str) -> ToolDelta:
        self._text += text
        if self._mode == "start":
            self._decide()
        if self._mode == "text":
            return self._text_delta()
        if self._mode == "calls":
            return self._calls_delta()
        return ToolDelta()

    def finish(self) -> ToolDelta:
        """The rest, at the end of the text."""
        if self._mode == "marked":
            calls = _marked_calls(self._text[self._marked_start :], self.request, self._names)
            if calls:
                return self._commit_whole(calls)
        if self._mode in ("start", "text", "marked") or not self._committed:
            content, self._sent = self._text[self._sent :], len(self._text)
            return ToolDelta(content=content)
        return ToolDelta()

    # ---- modes ------------------------------------------------------------------------------

    def _decide(self) -> None:
        stripped = self._text.lstrip()
        if not stripped:
            return
        if stripped[0] in "{[":
            self._mode = "calls"
            self._scanner = CallScanner(len(self._text) - len(stripped), self._names.__contains__)
        else:
            self._mode = "text"

    def _text_delta(self) -> ToolDelta:
        end = len(self._text)
        if self._reads_markers:
            found = _first_marker(self._text, self._sent)
            if found is not None:
                self._mode, self._marked_start, end = "marked", found, found
            else:
                end -= _partial_marker_len(self._text)
        # Only blanks so far: maybe the lead-in of tagged calls (once text went out, it was not).
        if self._sent == 0 and not self._text[:end].strip():
            return ToolDelta()
        content, self._sent = self._text[self._sent : end], max(self._sent, end)
        return ToolDelta(content=content)

    def _calls_delta(self) -> ToolDelta:
        scanner = self._scanner
        assert scanner is not None, "calls mode has a scanner"
        scanner.scan(self._text)
        delta = ToolDelta()
        for scanned in scanner.calls:
            if not self.request.allows_many and self._committed and not self._owns(scanned):
                break  # one call only: the rest is ignored
            delta.tool_calls.extend(self._call_entries(scanned, scanner.pos))
        return delta

    def _owns(self, scanned: ScannedCall) -> bool:
        return any(c.scanned is scanned for c in self._committed)

    def _call_entries(self, scanned: ScannedCall, pos: int) -> list[dict]:
        committed = next((c for c in self._committed if c.scanned is scanned), None)
        if committed is None:
            if scanned.name is None or (scanned.args_start is None and not scanned.is_closed):
                return []
            committed = _Committed(len(self._committed), scanned)
            self._committed.append(committed)
            return [_header(committed.index, scanned.name, self._new_arguments(committed, pos))]
        arguments = self._new_arguments(committed, pos)
        return [_fragment(committed.index, arguments)] if arguments else []

    def _new_arguments(self, committed: _Committed, pos: int) -> str:
        scanned = committed.scanned
        assert scanned is not None, "only scanned calls stream"
        if scanned.args_start is None:  # closed without arguments: "{}", once
            sent, committed.args_sent = committed.args_sent, 1
            return "" if sent else "{}"
        start = max(committed.args_sent, scanned.args_start)
        end = scanned.args_end if scanned.args_end is not None else pos
        committed.args_sent = max(start, end)
        return self._text[start:end]

    def _commit_whole(self, calls: list[tuple[str, str]]) -> ToolDelta:
        content = self._text[self._sent : self._marked_start]
        self._sent = self._marked_start
        delta = ToolDelta(content=content if (self._text[: self._marked_start]).strip() else "")
        for name, arguments in calls:
            committed = _Committed(len(self._committed), None)
            self._committed.append(committed)
            delta.tool_calls.append(_header(committed.index, name, arguments))
        return delta


def _header(index: int, name: str, arguments: str) -> dict:
    return {
        "index": index,
        "id": new_call_id(),
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def _fragment(index: int, arguments: str) -> dict:
    return {"index": index, "function": {"arguments": arguments}}


# ---- tags and fences ------------------------------------------------------------------------


def _first_marker(text: str, start: int) -> int | None:
    found = [i for i in (text.find(m, start) for m in _MARKERS) if i >= 0]
    return min(found) if found else None


def _partial_marker_len(text: str) -> int:
    """How many trailing characters may be the start of a marker (held back)."""
    return max(
        (n for marker in _MARKERS for n in range(1, len(marker)) if text.endswith(marker[:n])),
        default=0,
    )


def _marked_calls(text: str, request: ToolRequest, names: set[str]) -> list[tuple[str, str]] | None:
    """(name, arguments JSON) of each call in `text` if it is only tagged or fenced calls."""
    calls: list[tuple[str, str]] = []
    rest = text.lstrip()
    while rest:
        marker = next((m for m in _MARKERS if rest.startswith(m)), None)
        if marker is None:
            return None
        body, _, rest = rest[len(marker) :].partition(_MARKERS[marker])
        found = _calls_in(body, names)
        if found is None:
            return None
        calls.extend(found)
        rest = rest.lstrip()
    if not request.allows_many:
        calls = calls[:1]
    return calls or None


def _calls_in(body: str, names: set[str]) -> list[tuple[str, str]] | None:
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return None
    items = value if isinstance(value, list) else [value]
    calls = [_whole_call(item, names) for item in items]
    if not calls or any(call is None for call in calls):
        return None
    return calls  # type: ignore[return-value]


def _whole_call(item: object, names: set[str]) -> tuple[str, str] | None:
    if not isinstance(item, dict) or item.get("name") not in names or set(item) - set(CALL_KEYS):
        return None
    arguments = item.get("arguments", {})
    if isinstance(arguments, str):  # arguments written as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return item["name"], json.dumps(arguments, ensure_ascii=False, separators=(", ", ": "))


# ---- whole answers --------------------------------------------------------------------------


@dataclass(frozen=True)
class ParsedAnswer:
    content: str | None
    tool_calls: list[dict]  # OpenAI message shape: id, type, function {name, arguments}


def parse_answer(request: ToolRequest, text: str) -> ParsedAnswer:
    """A whole answer, read as a stream of one piece would be."""
    parser = ToolCallParser(request)
    delta = parser.feed(text).extend(parser.finish())
    return assemble(delta)


def assemble(delta: ToolDelta) -> ParsedAnswer:
    """Stream entries merged into a message, as the OpenAI client merges them."""
    calls: dict[int, dict] = {}
    for entry in delta.tool_calls:
        call = calls.setdefault(
            entry["index"], {"id": "", "type": "function", "function": {"arguments": ""}}
        )
        if "id" in entry:
            call["id"] = entry["id"]
        if "name" in entry["function"]:
            call["function"]["name"] = entry["function"]["name"]
        call["function"]["arguments"] += entry["function"]["arguments"]
    ordered = [calls[index] for index in sorted(calls)]
    if not ordered:
        return ParsedAnswer(delta.content, [])
    return ParsedAnswer(delta.content or None, ordered)
