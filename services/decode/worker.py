"""What a decode pod does with a request, free of protobuf: `DecodeWorkerCore`.

The servicer (services/decode/servicer.py) only translates proto <-> these dataclasses. Where
the prompt gets prefilled is decided in one place, `DecodeWorkerCore._prefill`, which the
remote-prefill path (KV pages from a prefill pod into this pod's blocks) slots into.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from enum import StrEnum

from shared.async_llm import AsyncLLM
from shared.engine import EngineStats
from shared.outputs import StreamDelta
from shared.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class PrefillMode(StrEnum):
    LOCAL = "local"  # no prefill pod was named: this pod computes the prompt
    REMOTE = "remote"  # a prefill pod wrote the prompt's KV pages into this pod's blocks
    LOCAL_FALLBACK = "local-fallback"  # a prefill pod was named but could not be used


@dataclass(frozen=True)
class WorkerIdentity:
    """What a pod says about itself in its stats; fixed for the life of the process."""

    worker_id: str
    role: str  # "decode" (or "colocated" once a pod runs both roles by design)
    model_name: str  # the name the gateway validates requests against
    kv_transport: str  # "ucx" or "tcp": the KV transport this pod speaks
    kv_address: str = ""  # where prefill pods send pages; empty until a transport listens


@dataclass(frozen=True)
class DecodeOutput:
    """One engine delta of a request, with how its prompt was prefilled."""

    delta: StreamDelta
    prefill_mode: PrefillMode
    num_prompt_tokens: int


@dataclass(frozen=True)
class DecodeWorkerStats:
    identity: WorkerIdentity
    engine: EngineStats
    max_model_len: int
    block_size: int
    vocab_size: int


class DecodeWorkerCore:
    """Runs requests on one `AsyncLLM`; one per process, used from the event loop only."""

    def __init__(self, llm: AsyncLLM, identity: WorkerIdentity) -> None:
        self.llm = llm
        self.identity = identity
        self._in_flight: set[str] = set()  # request ids being streamed, for Abort's answer

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        prefill_address: str = "",
    ) -> AsyncIterator[DecodeOutput]:
        """Streams the request's deltas; the last one has `finished` set and a `final`.

        Raises ValueError before the first output for a request this pod can never serve.
        Closing the iterator early (the caller went away, or was cancelled) aborts the request
        in the engine and frees its blocks.
        """
        if not request_id:
            raise ValueError("request_id must not be empty")
        if params.n != 1:
            raise ValueError(f"n must be 1 on a decode pod (the gateway fans out), got {params.n}")
        if request_id in self._in_flight:
            raise ValueError(f"request_id {request_id!r} is already in use")
        mode = await self._prefill(request_id, prompt_token_ids, params, prefill_address)
        self._in_flight.add(request_id)
        try:
            async for delta in self.llm.generate(prompt_token_ids, params, request_id, priority):
                yield DecodeOutput(delta, mode, len(prompt_token_ids))
        finally:
            self._in_flight.discard(request_id)

    async def _prefill(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prefill_address: str,
    ) -> PrefillMode:
        """Where the prompt's KV comes from. An empty address means this pod prefills."""
        if not prefill_address:
            return PrefillMode.LOCAL
        # TODO(lead): the engine-side disaggregation hook goes here: allocate this request's
        # decode blocks, call PrefillWorker.Prefill at `prefill_address` with a KVDestination
        # (this pod's kv_address and block ids), wait for the pages over shared/kv_transfer,
        # join the running batch with the first token, and return PrefillMode.REMOTE. Any
        # failure or timeout returns LOCAL_FALLBACK with every allocated block freed.
        logger.debug("request %s: remote prefill not wired yet; prefilling locally", request_id)
        return PrefillMode.LOCAL_FALLBACK

    def abort(self, request_id: str) -> bool:
        """Aborts a request still streaming here; False when there is none by that id."""
        if request_id not in self._in_flight:
            return False
        self.llm.abort(request_id)
        return True

    def stats(self) -> DecodeWorkerStats:
        engine = self.llm.engine
        return DecodeWorkerStats(
            identity=self.identity,
            engine=self.llm.stats(),
            max_model_len=engine.max_model_len,
            block_size=self.llm.config.cache.block_size,
            vocab_size=engine.architecture.vocab_size,
        )

    def token_text(self, token_id: int) -> str:
        """The text of one token as a client sees it (special tokens spelled out)."""
        return self.llm.tokenizer.decode([token_id], skip_special_tokens=False)

    def shutdown(self) -> None:
        self.llm.shutdown()
