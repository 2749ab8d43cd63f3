"""What /v1/messages answers: the message object, its server-sent events, and Anthropic's error
bodies and status codes for the endpoint's errors.

- Content blocks: the answer read by the tool calling parser (tools/calls.py) when the request
  has tools: text before calls is a `text` block, each call a `tool_use` block whose `input` is
  the arguments object (its id `toolu_` and 24 hex digits). A streamed answer and a whole one
  go through the same writer, so they hold the same blocks.
- `stop_reason`: `max_tokens` (the length ran out), `tool_use` (the answer made calls),
  `stop_sequence` (with `stop_sequence` set to the one matched), else `end_turn`.
- `usage`: `cache_read_input_tokens` is the prompt tokens found cached (as OpenAI's
  `cached_tokens`); when the request carries `cache_control`, the prompt tokens it computed are
  `cache_creation_input_tokens` (the decode pod now keeps them cached for the window asked for),
  otherwise 0; `input_tokens` is the rest, so the three sum to the prompt's tokens as in
  Anthropic's API.
- Events: `message_start` (usage so far: the prompt's tokens; cached ones are known at the
  end), `ping`, then per block `content_block_start`, `content_block_delta` (`text_delta` or
  `input_json_delta`), `content_block_stop`, then `message_delta` (stop_reason and the whole
  usage) and `message_stop`. An error after the 200 is an `error` event.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from splitserve.common.grpc_server import StatusError
from splitserve.gateway.api.respond import annotate_usage, error_response, sse
from splitserve.gateway.generation import Generation
from splitserve.gateway.outputs import CollectedSequence, SequenceChunk, Usage
from splitserve.gateway.tools.calls import ToolCallParser, ToolDelta
from splitserve.gateway.tools.request import ToolRequest

logger = logging.getLogger(__name__)

MESSAGES_PATHS = ("/v1/messages", "/v1/messages/count_tokens")
# Anthropic's error types by status (docs.anthropic.com/en/api/errors).
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    504: "timeout_error",
    529: "overloaded_error",
}
# Our statuses that Anthropic spells otherwise: no pod to serve is its "overloaded".
_STATUSES = {422: 400, 502: 500, 503: 529}


def anthropic_error(status: int, openai_body: dict) -> tuple[int, dict]:
    """An error's status and OpenAI body (respond.error_response) as Anthropic's."""
    error = openai_body.get("error", {})
    if error.get("code") == "model_not_found":
        status = 404
    status = _STATUSES.get(status, status)
    kind = _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return status, {"type": "error", "error": {"type": kind, "message": error.get("message", "")}}


def new_tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


@dataclass
class _ContentWriter:
    """One answer's text as content blocks and their stream events; `feed` each piece of
    text, the last with `is_last`."""

    tools: ToolRequest | None
    blocks: list[dict] = field(default_factory=list)
    _parser: ToolCallParser | None = None
    _arguments: dict[int, str] = field(default_factory=dict)  # block index -> arguments text
    _call_blocks: dict[int, int] = field(default_factory=dict)  # call index -> block index
    _open: int | None = None  # the block being written

    def __post_init__(self) -> None:
        if self.tools is not None and self.tools.is_parsed:
            self._parser = ToolCallParser(self.tools)

    @property
    def has_calls(self) -> bool:
        return bool(self._call_blocks)

    def feed(self, text: str, is_last: bool) -> list[dict]:
        if self._parser is None:
            delta = ToolDelta(content=text)
        else:
            delta = self._parser.feed(text)
            if is_last:
                delta.extend(self._parser.finish())
        events = self._text(delta.content) if delta.content else []
        for entry in delta.tool_calls:
            events += self._call(entry)
        if is_last:
            events += self._close()
        return events

    def content(self) -> list[dict]:
        """The whole blocks (once the last piece was fed)."""
        return [
            {**block, "input": _input(self._arguments[i])} if block["type"] == "tool_use" else block
            for i, block in enumerate(self.blocks)
        ]

    def _text(self, text: str) -> list[dict]:
        events: list[dict] = []
        if self._open is None or self.blocks[self._open]["type"] != "text":
            events += self._start({"type": "text", "text": ""})
        index = self._open
        assert index is not None, "a block was just started"
        self.blocks[index]["text"] += text
        events.append(_delta(index, {"type": "text_delta", "text": text}))
        return events

    def _call(self, entry: dict) -> list[dict]:
        function = entry["function"]
        events: list[dict] = []
        if "id" in entry:  # a call starts
            block = {"type": "tool_use", "id": new_tool_use_id(), "name": function["name"]}
            events += self._start({**block, "input": {}})
            assert self._open is not None, "a block was just started"
            self._call_blocks[entry["index"]] = self._open
            self._arguments[self._open] = ""
        index = self._call_blocks[entry["index"]]
        if function["arguments"]:
            self._arguments[index] += function["arguments"]
            delta = {"type": "input_json_delta", "partial_json": function["arguments"]}
            events.append(_delta(index, delta))
        return events

    def _start(self, block: dict) -> list[dict]:
        events = self._close()
        self.blocks.append(block)
        self._open = len(self.blocks) - 1
        start = {"type": "content_block_start", "index": self._open, "content_block": block}
        return [*events, json.loads(json.dumps(start))]  # a copy: the block keeps growing

    def _close(self) -> list[dict]:
        if self._open is None:
            return []
        index, self._open = self._open, None
        return [{"type": "content_block_stop", "index": index}]


def _delta(index: int, delta: dict) -> dict:
    return {"type": "content_block_delta", "index": index, "delta": delta}


def _input(arguments: str) -> object:
    """A call's input; arguments cut short by max_tokens give what of them parses: {}."""
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return {}


@dataclass
class MessageFormat:
    """The message object and the events of one /v1/messages request."""

    message_id: str
    model: str
    tools: ToolRequest | None
    stop_sequences: tuple[str, ...]
    creates_cache: bool  # the request carries cache_control (see the module's docstring)

    def message(self, sequence: CollectedSequence, usage: Usage) -> dict:
        writer = _ContentWriter(self.tools)
        writer.feed(sequence.text, is_last=True)
        stop = self._stop(sequence.finish_reason, sequence.stop_reason, writer.has_calls)
        return self._object(writer.content(), stop, self.usage(usage))

    def usage(self, usage: Usage) -> dict:
        cached = usage.cached_tokens
        created = usage.prompt_tokens - cached if self.creates_cache else 0
        return {
            "input_tokens": usage.prompt_tokens - cached - created,
            "output_tokens": usage.completion_tokens,
            "cache_creation_input_tokens": created,
            "cache_read_input_tokens": cached,
        }

    async def events(self, generation: Generation, first: SequenceChunk) -> AsyncIterator[dict]:
        """Every event of the stream, `first` (already received) included; raises what the
        generation raises."""
        start_usage = self.usage(Usage(prompt_tokens=generation.usage.prompt_tokens))
        message = self._object([], (None, None), start_usage)
        yield {"type": "message_start", "message": message}
        yield {"type": "ping"}
        writer = _ContentWriter(self.tools)
        finish_reason, stop_text = None, None
        chunk: SequenceChunk | None = first
        while chunk is not None:
            is_last = chunk.finish_reason is not None
            for event in writer.feed(chunk.text, is_last):
                yield event
            if is_last:
                finish_reason, stop_text = chunk.finish_reason, chunk.stop_reason
            chunk = await anext(generation, None)
        if finish_reason is None:  # ended without its last chunk: close what is open
            for event in writer.feed("", is_last=True):
                yield event
        stop_reason, stop_sequence = self._stop(finish_reason, stop_text, writer.has_calls)
        yield {
            "type": "message_delta",
            "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
            "usage": self.usage(generation.usage),
        }
        yield {"type": "message_stop"}

    def _stop(
        self, finish_reason: str | None, stop_text: str | None, has_calls: bool
    ) -> tuple[str | None, str | None]:
        """(stop_reason, stop_sequence)."""
        if finish_reason == "length":
            return "max_tokens", None
        if has_calls:
            return "tool_use", None
        if stop_text is not None and stop_text in self.stop_sequences:
            return "stop_sequence", stop_text
        return "end_turn", None

    def _object(
        self, content: list[dict], stop: tuple[str | None, str | None], usage: dict
    ) -> dict:
        return {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": stop[0],
            "stop_sequence": stop[1],
            "usage": usage,
        }


async def message_events(
    fmt: MessageFormat, generation: Generation, first: SequenceChunk
) -> AsyncIterator[str]:
    """The events as Anthropic sends them, each named in its `event:` line."""
    try:
        async for event in fmt.events(generation, first):
            yield f"event: {event['type']}\n" + sse(event)
    except (ValueError, StatusError) as error:
        # The 200 went out with the first events: the error can only travel as an event.
        logger.warning("stream %s failed: %s", fmt.message_id, error)
        _, body = anthropic_error(*error_response(error))
        yield "event: error\n" + sse(body)
    else:
        annotate_usage(generation)
