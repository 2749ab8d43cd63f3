"""What the prefill and decode pods share around their engine, as one base class each side:

- `EnginePodCore`: the engine-backed request handler of a pod, free of protobuf: identity,
  metrics, per-request step timings, the requests in flight, abort, stats, close. The role's
  core adds its request path (`prefill` or `generate`) and its end of the KV transport.
- `PodServicerBase`: the gRPC side every engine pod answers the same way (readiness while the
  model loads, Abort, GetStats); the role's servicer adds its one request method.

Torch-free like the rest of services/common: the engine is only named for type checking.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Generic, Protocol, TypeVar

import grpc

from splitserve.common.grpc_server import StatusError
from splitserve.engine.lora.request import LoRARequest
from splitserve.engine.step_costs_fit import fit_step_costs
from splitserve.engine.telemetry import record_engine_steps
from splitserve.pod.metrics import PodMetrics
from splitserve.pod.server import (
    PodIdentity,
    PodStats,
    pod_stats,
    pod_stats_to_proto,
    token_text,
)
from splitserve.v1 import worker_pb2

if TYPE_CHECKING:
    from splitserve.engine.async_llm import AsyncLLM


class Abortable(Protocol):
    def abort(self) -> None:
        """Stops what a request has under way outside the engine (a remote prefill)."""


class EnginePodCore:
    """One per process, used from the event loop only. `start()` (on that loop) must run
    before the first request."""

    role: ClassVar[str]  # "prefill" or "decode"

    def __init__(
        self, llm: AsyncLLM, identity: PodIdentity, metrics: PodMetrics | None = None
    ) -> None:
        self.llm = llm
        self.identity = identity
        lora_info = llm.lora_info if llm.engine.lora is not None else None
        self.metrics = metrics or PodMetrics(self.role, identity.model_name, llm.stats, lora_info)
        self._steps = record_engine_steps(llm.engine)  # queue time and chunks, per request
        self._step_costs = fit_step_costs(llm.engine)  # what a step costs here, for GetStats
        # request id -> what besides the engine an abort must stop (None: nothing), while the
        # request is in flight here
        self._in_flight: dict[str, Abortable | None] = {}
        # name -> the adapter requests may name (--lora-modules, then runtime loads); read
        # once here, before the engine thread runs requests, then kept by load/unload_lora.
        self.loras: dict[str, LoRARequest] = {
            lora.lora_name: lora for lora in llm.engine.list_loras()
        }

    def _check_new_request_id(self, request_id: str) -> None:
        if not request_id:
            raise ValueError("request_id must not be empty")
        if request_id in self._in_flight:
            raise ValueError(f"request_id {request_id!r} is already in use")

    async def start(self) -> None:
        """Starts what must run on the event loop (the role's end of the KV transport)."""

    def abort(self, request_id: str) -> bool:
        """Aborts a request in flight here; False when there is none by that id."""
        if request_id not in self._in_flight:
            return False
        self.llm.abort(request_id)
        under_way = self._in_flight[request_id]
        if under_way is not None:
            under_way.abort()
        return True

    def stats(self) -> PodStats:
        return pod_stats(self.llm, self.identity, tuple(self.loras), self._step_costs.costs())

    # ---- LoRA adapters ----------------------------------------------------------------------

    def lora_request(self, lora_name: str) -> LoRARequest | None:
        """The adapter a request names ("" = the base model: None); NOT_FOUND for one this pod
        does not hold."""
        if not lora_name:
            return None
        lora = self.loras.get(lora_name)
        if lora is None:
            raise StatusError(
                grpc.StatusCode.NOT_FOUND, f"LoRA adapter {lora_name!r} is not loaded on this pod"
            )
        return lora

    async def load_lora(self, lora_name: str, lora_path: str) -> bool:
        """Registers and reads a new adapter under the next free id; False when it is loaded
        from that path already. ValueError for a bad adapter, a name taken by another path,
        or a pod without LoRA."""
        known = self.loras.get(lora_name)
        if known is not None:
            if known.lora_path != lora_path:
                raise ValueError(
                    f"lora_name {lora_name!r} is already loaded from {known.lora_path!r}; "
                    "unload it first"
                )
            return False
        next_id = max((lora.lora_int_id for lora in self.loras.values()), default=0) + 1
        lora = LoRARequest(lora_name, next_id, lora_path)
        await self.llm.add_lora(lora)
        self.loras[lora_name] = lora
        return True

    async def unload_lora(self, lora_name: str) -> bool:
        """Forgets the adapter; NOT_FOUND for one not loaded, ValueError while requests run
        with it."""
        lora = self.loras.pop(lora_name, None)  # new requests cannot name it from now on
        if lora is None:
            raise StatusError(
                grpc.StatusCode.NOT_FOUND, f"LoRA adapter {lora_name!r} is not loaded on this pod"
            )
        try:
            await self.llm.remove_lora(lora_name)
        except ValueError:
            self.loras[lora_name] = lora
            raise
        return True

    def token_text(self, token_id: int) -> str:
        return token_text(self.llm, token_id)

    async def close(self) -> None:
        """Stops the transport, then the engine; requests still in flight fail."""
        await self._close_transport()
        self.llm.shutdown()

    async def _close_transport(self) -> None:
        """Closes the role's end of the KV transport, if it opened one."""


CoreT = TypeVar("CoreT", bound=EnginePodCore)


class PodServicerBase(Generic[CoreT]):
    """Registered before the model loads (so health answers meanwhile); `core` is set once the
    engine is up, and calls before that are UNAVAILABLE. Put it before the generated servicer
    class in the bases, so these methods answer instead of its UNIMPLEMENTED ones."""

    def __init__(self) -> None:
        self.core: CoreT | None = None

    async def Abort(self, request: worker_pb2.AbortRequest, context) -> worker_pb2.AbortResponse:
        core = await self._ready(context)
        return worker_pb2.AbortResponse(found=core.abort(request.request_id))

    async def GetStats(self, request: worker_pb2.StatsRequest, context) -> worker_pb2.WorkerStats:
        core = await self._ready(context)
        return pod_stats_to_proto(core.stats())

    async def LoadLoRAAdapter(
        self, request: worker_pb2.LoadLoRAAdapterRequest, context
    ) -> worker_pb2.LoRAAdapterResponse:
        core = await self._ready(context)
        changed = await core.load_lora(request.lora_name, request.lora_path)
        return worker_pb2.LoRAAdapterResponse(changed=changed)

    async def UnloadLoRAAdapter(
        self, request: worker_pb2.UnloadLoRAAdapterRequest, context
    ) -> worker_pb2.LoRAAdapterResponse:
        core = await self._ready(context)
        return worker_pb2.LoRAAdapterResponse(changed=await core.unload_lora(request.lora_name))

    async def _ready(self, context) -> CoreT:
        core = self.core
        if core is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the model is still loading")
        assert core is not None, "context.abort raises"
        return core
