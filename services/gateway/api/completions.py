"""POST /v1/completions: the body (`CompletionBody`), its parsing into engine terms, the route,
and the completion objects and chunks it answers with (`CompletionFormat`, logprobs in the
legacy parallel-list layout)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import Field

from splitserve.common import tracing
from splitserve.engine.sampling_params import MAX_LOGPROBS, SamplingParams
from splitserve.gateway.api.fields import (
    CommonOptions,
    SamplingFields,
    apply_cache_retention,
    apply_structured_output,
    check_unsupported,
    common_options,
    doc_field,
    sampling_kwargs,
    unsupported_field,
    validate_body,
)
from splitserve.gateway.api.format import (
    ChoicesFormat,
    choice_json,
    clamp_logprob,
    usage_json,
)
from splitserve.gateway.api.respond import respond, start_choices
from splitserve.gateway.core import GatewayCore, ServedModels
from splitserve.gateway.errors import RequestError
from splitserve.gateway.outputs import CollectedSequence, SequenceChunk, Usage
from splitserve.v1 import generate_pb2

# The OpenAI API's default for completions; chat defaults to the rest of the context.
DEFAULT_COMPLETION_MAX_TOKENS = 16

Prompt = str | list[int] | list[str] | list[list[int]]


class CompletionBody(SamplingFields):
    prompt: Prompt = Field(
        description="A text, a list of token ids, or a non-empty list of either (one choice "
        "per prompt and n)."
    )
    max_tokens: int | None = doc_field("Tokens to generate (default 16).", minimum=1)
    logprobs: int | None = doc_field(
        "Top alternatives per generated token.", minimum=0, maximum=MAX_LOGPROBS
    )
    echo: bool | None = doc_field(
        "Put the prompt's text before each choice's text (not together with logprobs: prompt "
        "logprobs are not computed)."
    )
    best_of: int | None = doc_field("Only equal to n (no beam search).", minimum=1)
    add_special_tokens: bool | None = doc_field(
        "vLLM's extension: tokenize a text prompt with the model's BOS/EOS (default true)."
    )
    suffix: str | None = unsupported_field("insertion (suffix); null or empty only")

    UNSUPPORTED: ClassVar[dict[str, tuple[object, ...]]] = {
        **SamplingFields.UNSUPPORTED,
        "suffix": (None, ""),
    }


@dataclass(frozen=True)
class CompletionRequest:
    prompts: list[str | list[int]]
    options: CommonOptions
    echo: bool = False  # each choice's text starts with its prompt's
    add_special_tokens: bool = True  # for text prompts


def parse_completion(raw: object, model_name: str | ServedModels) -> CompletionRequest:
    body = validate_body(CompletionBody, raw)
    check_unsupported(body)
    sampling = sampling_kwargs(body)
    structured_output_param = apply_structured_output(sampling, body)
    if body.logprobs is not None:
        sampling["logprobs"] = body.logprobs
        if body.echo:
            raise RequestError(
                "echo together with logprobs is not supported (prompt logprobs are not "
                "computed); echo without logprobs is",
                "echo",
                "unsupported_value",
            )
    apply_cache_retention(sampling, body)
    options = common_options(body, model_name, sampling, body.max_tokens, structured_output_param)
    if body.best_of is not None and body.best_of != sampling.get("n", 1):
        raise RequestError("best_of must equal n (beam search is not supported)", "best_of")
    return CompletionRequest(
        _prompts(body.prompt),
        options,
        echo=bool(body.echo),
        add_special_tokens=body.add_special_tokens is not False,
    )


def _prompts(prompt: Prompt) -> list[str | list[int]]:
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompts: list = [prompt]
    elif prompt:
        prompts = list(prompt)
    else:
        raise RequestError(
            "prompt must be a string, a list of token ids, or a non-empty list of either",
            "prompt",
            "invalid_type",
        )
    if any(len(p) == 0 for p in prompts):
        raise RequestError("prompt must not be empty", "prompt")
    return prompts


# ---- the route ------------------------------------------------------------------------------


class CompletionRoutes:
    def __init__(self, core: GatewayCore) -> None:
        self.core = core

    def add_to(self, app: FastAPI) -> None:
        app.add_api_route("/v1/completions", self.completions, methods=["POST"])

    async def completions(self, body: CompletionBody, request: Request) -> Response:
        core = self.core
        with tracing.child_span("gateway.validate", None):
            parsed = parse_completion(body, core.served_models())
        with tracing.child_span("gateway.tokenize", None):
            prompts = [
                core.encode(p, parsed.add_special_tokens) if isinstance(p, str) else p
                for p in parsed.prompts
            ]
        options = parsed.options
        started = await start_choices(
            core, options, prompts, DEFAULT_COMPLETION_MAX_TOKENS, "cmpl-", "prompt", request
        )
        generation, params = started.generation, started.params
        fmt = CompletionFormat(
            started.envelope,
            options,
            logprobs=params.logprobs is not None,
            num_prompt_tokens=generation.usage.prompt_tokens,
            echo=_echo_texts(core, parsed, prompts, params),
        )
        return await respond(request, generation, fmt, options)


def _echo_texts(
    core: GatewayCore, parsed: CompletionRequest, prompts: list[list[int]], params: SamplingParams
) -> list[str]:
    """Each choice's prompt text for `echo` (a token-id prompt decoded); [] without echo."""
    if not parsed.echo:
        return []
    texts = [
        given if isinstance(given, str) else core.tokenizer.decode(ids, params.skip_special_tokens)
        for given, ids in zip(parsed.prompts, prompts)
    ]
    return [text for text in texts for _ in range(params.n)]


# ---- formatting -----------------------------------------------------------------------------


@dataclass
class CompletionFormat(ChoicesFormat):
    """Completion objects and chunks for one request."""

    chunk_object = "text_completion"
    # choice -> its prompt's text, put before its text (`echo`); empty: no echo
    echo: list[str] = field(default_factory=list)
    _offsets: dict[int, int] = field(default_factory=dict)  # choice -> text offset so far
    _echoed: set[int] = field(default_factory=set)  # choices whose prompt was sent

    def chunk(self, chunk: SequenceChunk) -> dict:
        logprobs = self._logprobs(chunk.index, chunk.logprobs)
        text = chunk.text
        if self.echo and chunk.index not in self._echoed:
            self._echoed.add(chunk.index)
            text = self.echo[chunk.index] + text
        choice = choice_json(chunk, {"text": text}, logprobs, self.options)
        return self._wrap_chunk(choice, chunk)

    def response(self, sequences: list[CollectedSequence], usage: Usage) -> dict:
        choices = [
            choice_json(
                sequence,
                {"text": (self.echo[sequence.index] if self.echo else "") + sequence.text},
                self._logprobs(sequence.index, sequence.logprobs),
                self.options,
            )
            for sequence in sequences
        ]
        return self.envelope.wrap("text_completion", choices, usage=usage_json(usage))

    def _logprobs(self, index: int, entries: list[generate_pb2.TokenLogprob]) -> dict | None:
        """The legacy completions layout: parallel lists, top alternatives as token -> logprob."""
        if not self.logprobs:
            return None
        offset = self._offsets.get(index, 0)
        offsets = []
        for entry in entries:
            offsets.append(offset)
            offset += len(entry.token)
        self._offsets[index] = offset
        return {
            "tokens": [entry.token for entry in entries],
            "token_logprobs": [clamp_logprob(entry.logprob) for entry in entries],
            "top_logprobs": [_top_dict(entry) for entry in entries],
            "text_offset": offsets,
        }


def _top_dict(entry: generate_pb2.TokenLogprob) -> dict[str, float]:
    top = {alt.token: clamp_logprob(alt.logprob) for alt in entry.top}
    top.setdefault(entry.token, clamp_logprob(entry.logprob))
    return top
