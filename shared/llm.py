"""The offline Python API: `LLM(model=..., **engine_options).generate(prompts, params)`."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator, Sequence

from splitserve.engine.config import EngineConfig
from splitserve.engine.core import EngineCore, EngineStats
from splitserve.engine.lora.request import LoRARequest
from splitserve.engine.outputs import CompletionOutput, RequestOutput, StreamDelta
from splitserve.engine.prompts import PromptInput, child_sequences, normalize_prompts
from splitserve.engine.sampling_params import SamplingParams


class LLM:
    """Runs the engine in the caller's thread until the submitted requests finish."""

    def __init__(self, model: str | None = None, progress=None, **engine_options: object) -> None:
        self.config = EngineConfig.from_options(model, **engine_options)
        self.engine = EngineCore(self.config, progress=progress)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def close(self) -> None:
        """Stops the other processes of a parallel engine, if any (also done at exit)."""
        self.engine.close()

    def generate(
        self,
        prompts: object,
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """One `RequestOutput` per prompt, in input order. All prompts are validated before
        any is queued, so a bad one raises `ValueError` and none runs. If the run itself fails
        (or is interrupted), this call's sequences are aborted so the engine stays usable.
        `lora_request`: one adapter for every prompt, or a list with one per prompt (None: the
        base model); needs an engine built with enable_lora."""
        inputs = normalize_prompts(prompts, self.tokenizer)
        all_params = _per_prompt(params, len(inputs), SamplingParams(), "params")
        priorities = _per_prompt(priority, len(inputs), 0, "priority")
        loras = _per_prompt(lora_request, len(inputs), None, "lora_request")
        for prompt, p, prio in zip(inputs, all_params, priorities):
            self.engine.validate_request(prompt.token_ids, p, prio)
        for lora in loras:
            self.engine.add_lora(lora)
        request_ids: list[str] = []
        with self._aborted_on_error(request_ids, all_params):
            for prompt, p, prio, lora in zip(inputs, all_params, priorities, loras):
                request_ids.append(self._submit(prompt, p, prio, lora))
            finals = self._run_until_done()
        return [
            _request_output(rid, prompt, p, finals)
            for rid, prompt, p in zip(request_ids, inputs, all_params)
        ]

    def chat(
        self, messages: list[dict[str, str]], params: SamplingParams | None = None
    ) -> RequestOutput:
        prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        token_ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        return self.generate([token_ids], params)[0]

    def stream(self, prompt: object, params: SamplingParams | None = None) -> Iterator[StreamDelta]:
        """Yields deltas of one prompt's sequences as the engine produces them. Closing the
        iterator early (leaving a `for` loop) aborts the request and frees its blocks."""
        (single,) = normalize_prompts([prompt], self.tokenizer)
        params = params or SamplingParams()
        self.engine.validate_request(single.token_ids, params)
        request_ids = [self._submit(single, params, 0)]
        with self._aborted_on_error(request_ids, [params]):
            while self.engine.has_unfinished_requests():
                yield from self.engine.step()
                self.engine.take_kv_events()  # unpublished offline, as in _run_until_done

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def _submit(
        self,
        prompt: PromptInput,
        params: SamplingParams,
        priority: int,
        lora_request: LoRARequest | None = None,
    ) -> str:
        request_id = f"offline-{next(self._ids)}"
        for index, (child_id, child_params) in enumerate(child_sequences(request_id, params)):
            self.engine.add_request(
                child_id,
                prompt.token_ids,
                child_params,
                priority,
                index,
                lora_request=lora_request,
            )
        return request_id

    def _run_until_done(self) -> dict[str, CompletionOutput]:
        finals: dict[str, CompletionOutput] = {}
        while self.engine.has_unfinished_requests():
            for delta in self.engine.step():
                if delta.final is not None:
                    finals[delta.request_id] = delta.final
            # Nobody publishes an offline engine's cache: its events would only pile up.
            self.engine.take_kv_events()
        return finals

    @contextlib.contextmanager
    def _aborted_on_error(
        self, request_ids: list[str], all_params: list[SamplingParams]
    ) -> Iterator[None]:
        """Aborts the sequences of `request_ids` (filled in while the block runs) if the block
        does not finish: an exception, Ctrl-C, or a stream closed early. Finished sequences are
        no longer in the engine, so aborting them is a no-op."""
        completed = False
        try:
            yield
            completed = True
        finally:
            if not completed:
                sequence_ids = [
                    child_id
                    for request_id, params in zip(request_ids, all_params)
                    for child_id, _ in child_sequences(request_id, params)
                ]
                self.engine.abort_requests(sequence_ids)


def _per_prompt(value, count: int, default, name: str) -> list:
    if value is None:
        return [default] * count
    if not isinstance(value, list | tuple):
        return [value] * count
    if len(value) != count:
        raise ValueError(f"{name} has {len(value)} entries for {count} prompts")
    return list(value)


def _request_output(
    request_id: str,
    prompt: PromptInput,
    params: SamplingParams,
    finals: dict[str, CompletionOutput],
) -> RequestOutput:
    children = child_sequences(request_id, params)
    outputs = [finals[child_id] for child_id, _ in children]
    return RequestOutput(request_id, prompt.text, prompt.token_ids, outputs)
