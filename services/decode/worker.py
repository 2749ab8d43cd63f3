"""What a decode pod does with a request, free of protobuf: `DecodeWorkerCore`.

The servicer (services/decode/servicer.py) only translates proto <-> these dataclasses. Where
the prompt gets prefilled is decided in one place, `DecodeWorkerCore._remote_prefill`:

- no prefill pod named, or a prompt shorter than the threshold: prefill here ("local");
- otherwise reserve the blocks, and if the prompt's uncached part (what this pod's own prefix
  cache does not hold) is still at least the threshold, a prefill pod fills them ("remote");
- a prefill pod that fails, times out or is not there: prefill here ("local-fallback").
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

from services.common.pod import PodStats, WorkerIdentity, pod_stats, token_text
from services.decode.remote_prefill import (
    PrefillClient,
    PrefillMode,
    RemotePrefillAttempt,
    RemotePrefillSettings,
)
from shared.async_llm import AsyncLLM
from shared.kv_transfer import KVTransport
from shared.outputs import StreamDelta
from shared.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DecodeOutput:
    """One engine delta of a request, with how its prompt was prefilled."""

    delta: StreamDelta
    prefill_mode: PrefillMode
    num_prompt_tokens: int


class DecodeWorkerCore:
    """Runs requests on one `AsyncLLM`; one per process, used from the event loop only.
    `start()` (on that loop) must run before the first request: it listens for KV pages."""

    def __init__(
        self,
        llm: AsyncLLM,
        identity: WorkerIdentity,
        transport: KVTransport,
        settings: RemotePrefillSettings | None = None,
        kv_host: str = "127.0.0.1",
        kv_port: int = 0,
    ) -> None:
        self.llm = llm
        self.identity = identity
        self.settings = settings or RemotePrefillSettings()
        self._transport = transport
        self._kv_bind = (kv_host, kv_port)
        self._prefill_client: PrefillClient | None = None
        # request id -> its remote prefill attempt (None: prefilled here), while it streams
        self._in_flight: dict[str, RemotePrefillAttempt | None] = {}

    async def start(self) -> None:
        """Starts the KV receiver; its address goes into this pod's stats."""
        receiver = await self._transport.start_receiver(*self._kv_bind)
        self._prefill_client = PrefillClient(
            receiver, self._transport.kind, self.settings.timeout_s
        )
        self.identity = dataclasses.replace(self.identity, kv_address=receiver.address)
        logger.info("receiving KV pages at %s", receiver.address)

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
        here and on the prefill pod, and frees its blocks on both.
        """
        if not request_id:
            raise ValueError("request_id must not be empty")
        if params.n != 1:
            raise ValueError(f"n must be 1 on a decode pod (the gateway fans out), got {params.n}")
        if request_id in self._in_flight:
            raise ValueError(f"request_id {request_id!r} is already in use")
        attempt = self._remote_prefill(request_id, prompt_token_ids, params, prefill_address)
        self._in_flight[request_id] = attempt
        try:
            deltas = self.llm.generate(
                prompt_token_ids, params, request_id, priority, remote_prefill=attempt
            )
            async for delta in deltas:
                mode = PrefillMode.LOCAL if attempt is None else attempt.mode
                yield DecodeOutput(delta, mode, len(prompt_token_ids))
        finally:
            del self._in_flight[request_id]

    def _remote_prefill(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prefill_address: str,
    ) -> RemotePrefillAttempt | None:
        """The remote prefill to try, or None to prefill here without reserving first.

        The prompt's length bounds its uncached part from above, so a prompt shorter than the
        threshold is local at no cost; a longer one is decided once the reservation has told
        how much of it this pod holds already (`RemotePrefillAttempt`)."""
        threshold = self.settings.local_prefill_threshold
        if not prefill_address or len(prompt_token_ids) < threshold:
            return None
        assert self._prefill_client is not None, "start() runs before the first request"
        return RemotePrefillAttempt(
            self._prefill_client,
            prefill_address,
            request_id,
            prompt_token_ids,
            params,
            threshold,
        )

    def abort(self, request_id: str) -> bool:
        """Aborts a request still streaming here; False when there is none by that id."""
        if request_id not in self._in_flight:
            return False
        self.llm.abort(request_id)
        attempt = self._in_flight[request_id]
        if attempt is not None:
            attempt.abort()
        return True

    def stats(self) -> PodStats:
        return pod_stats(self.llm, self.identity)

    def token_text(self, token_id: int) -> str:
        return token_text(self.llm, token_id)

    async def close(self) -> None:
        if self._prefill_client is not None:
            await self._prefill_client.close()
        self.llm.shutdown()
