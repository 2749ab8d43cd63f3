"""An incremental scanner of the JSON tool calls a model writes (`{"name": ..., "arguments":
{...}}`, or an array of such), character by character as the text arrives, so a stream can
send each call's name as soon as it is known and its arguments as they are written.

It reads JSON structure only (nesting, strings, the keys of each call object) and records,
per call, the name and where the arguments object starts and ends in the text: the arguments
a client gets are that text exactly as generated, streamed or not. It stops (`is_done`) at the
end of the top-level value and gives up (`is_broken`) at anything that is not a call: a key
other than "name" and "arguments", a name that is no tool's, arguments that are no object.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

# The keys of a call object. Any other key makes it no call: a small model asked to call a tool
# may instead copy the tool's card ({"name", "description", "parameters"}) from its prompt.
CALL_KEYS = ("name", "arguments")
_CLOSING = {"{": "}", "[": "]"}


@dataclass
class ScannedCall:
    """One call object as read so far."""

    name: str | None = None
    args_start: int | None = None  # index of the arguments object's "{"
    args_end: int | None = None  # index just past its "}"
    is_closed: bool = False  # the call object's "}" was read
    # Inside the call object: "key", "colon", "value", "in_value" or "comma" comes next.
    expect: str = "key"
    key: str | None = None
    token_start: int = 0  # where the key or value being read started


class CallScanner:
    """Scans `text[start:]`; `scan(text)` continues from where the last call stopped."""

    def __init__(self, start: int, is_known: Callable[[str], bool]) -> None:
        self.pos = start  # next index to read
        self.calls: list[ScannedCall] = []
        self.is_done = False
        self.is_broken = False
        self._is_known = is_known
        self._stack: list[str] = []  # open "{" / "["
        self._in_string = False
        self._escaped = False
        self._is_array = False  # the top level is an array of calls

    @property
    def is_open(self) -> bool:
        return not (self.is_done or self.is_broken)

    @property
    def _call_depth(self) -> int:
        return 2 if self._is_array else 1

    @property
    def _call(self) -> ScannedCall | None:
        call = self.calls[-1] if self.calls else None
        return call if call is not None and not call.is_closed else None

    def scan(self, text: str) -> None:
        while self.is_open and self.pos < len(text):
            self._read(text, self.pos)
            self.pos += 1

    def _read(self, text: str, i: int) -> None:
        char = text[i]
        if self._in_string:
            self._read_in_string(text, i, char)
        elif char == '"':
            self._string_starts(i)
        elif char in "{[":
            self._opens(i, char)
        elif char in "}]":
            self._closes(text, i, char)
        else:
            self._reads_other(text, i, char)

    def _at_call_level(self) -> bool:
        return self._call is not None and len(self._stack) == self._call_depth

    def _read_in_string(self, text: str, i: int, char: str) -> None:
        if self._escaped:
            self._escaped = False
        elif char == "\\":
            self._escaped = True
        elif char == '"':
            self._in_string = False
            call = self._call
            if not self._at_call_level() or call is None:
                return
            if call.expect == "key":
                call.key = json.loads(text[call.token_start : i + 1])
                call.expect = "colon"
                if call.key not in CALL_KEYS:
                    self.is_broken = True
            elif call.expect == "in_value":
                self._value_ends(text, call, i + 1)

    def _string_starts(self, i: int) -> None:
        self._in_string = True
        if len(self._stack) < self._call_depth:  # a string where a call must be
            self.is_broken = True
            return
        call = self._call
        if not self._at_call_level() or call is None:
            return
        if call.expect == "key":
            call.token_start = i
        elif call.expect == "value":
            call.token_start = i
            call.expect = "in_value"
        else:
            self.is_broken = True

    def _opens(self, i: int, char: str) -> None:
        depth = len(self._stack)
        if depth == 0:
            self._is_array = char == "["
        if depth == self._call_depth - 1:  # a call object starts
            if char != "{":
                self.is_broken = True
                return
            self.calls.append(ScannedCall())
        elif depth == self._call_depth:
            call = self._call
            if call is None or call.expect != "value":
                self.is_broken = True
                return
            call.token_start = i
            call.expect = "in_value"
            if call.key == "arguments" and char == "{":
                call.args_start = i
        self._stack.append(char)

    def _closes(self, text: str, i: int, char: str) -> None:
        call = self._call
        if self._at_call_level() and call is not None and call.expect == "in_value":
            self._value_ends(text, call, i)  # a number or literal just before "}"
        if not self._stack or _CLOSING[self._stack[-1]] != char:
            self.is_broken = True
            return
        self._stack.pop()
        depth = len(self._stack)
        if depth == self._call_depth and call is not None:  # a value object/array ends
            self._value_ends(text, call, i + 1)
        elif depth == self._call_depth - 1 and call is not None:  # the call object ends
            self._call_closes(call)
        if depth == 0:
            self.is_done = True

    def _call_closes(self, call: ScannedCall) -> None:
        if call.expect not in ("comma", "key") or call.name is None:
            self.is_broken = True
            return
        call.is_closed = True

    def _reads_other(self, text: str, i: int, char: str) -> None:
        call = self._call if self._at_call_level() else None  # None: not at the call's level
        if char in " \t\r\n":
            if call is not None and call.expect == "in_value":
                self._value_ends(text, call, i)
            return
        if len(self._stack) < self._call_depth:
            # Between the calls of an array only commas may come.
            if not (self._is_array and len(self._stack) == 1 and char == ","):
                self.is_broken = True
            return
        if call is None:
            return  # inside a value: its own business
        if char == ":" and call.expect == "colon":
            call.expect = "value"
        elif char == "," and call.expect in ("comma", "in_value"):
            if call.expect == "in_value":
                self._value_ends(text, call, i)
            call.expect = "key"
        elif call.expect == "value":  # a number, true, false or null starts
            call.token_start = i
            call.expect = "in_value"
        elif call.expect != "in_value":
            self.is_broken = True

    def _value_ends(self, text: str, call: ScannedCall, end: int) -> None:
        call.expect = "comma"
        if call.key == "name":
            name = _json_or_none(text[call.token_start : end])
            if not isinstance(name, str) or not self._is_known(name):
                self.is_broken = True
                return
            call.name = name
        elif call.key == "arguments":
            if call.args_start is None:  # arguments that are not an object
                self.is_broken = True
                return
            call.args_end = end


def _json_or_none(text: str) -> object:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None
