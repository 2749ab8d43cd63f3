"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's runtime adapter API): the
call goes to every available pod, prefill and decode alike (a request may run on any of them,
and prefill and decode must hold the same adapter), then the pools are polled again so
/v1/models and routing see the change at once. The gate (auth/) guards these paths as every
other when the gateway has API keys."""

from __future__ import annotations

import asyncio
import logging

import grpc
from fastapi import FastAPI
from fastapi.responses import PlainTextResponse

from splitserve.common.grpc_server import StatusError
from splitserve.gateway.core import GatewayCore, NoPodError
from splitserve.gateway.errors import RequestError
from splitserve.gateway.routing.pods import Pod, PodPool
from splitserve.gateway.strict_model import StrictModel
from splitserve.v1 import worker_pb2

logger = logging.getLogger(__name__)

ADMIN_TIMEOUT_S = 60.0  # reading an adapter from disk may take a while


class LoadLoRAAdapterBody(StrictModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterBody(StrictModel):
    lora_name: str
    lora_int_id: int | None = None  # vLLM's body has it; names are what pods go by


class LoRAAdapterRoutes:
    def __init__(self, core: GatewayCore) -> None:
        self.core = core
        # name -> path of the adapters loaded through this gateway and not unloaded: a pod
        # that comes up later (a new one, or one restarted without them) gets them too.
        self.runtime_loras: dict[str, str] = {}
        for pool in self._pools():
            pool.on_pod_up = self._give_runtime_loras

    def add_to(self, app: FastAPI) -> None:
        app.add_api_route("/v1/load_lora_adapter", self.load, methods=["POST"])
        app.add_api_route("/v1/unload_lora_adapter", self.unload, methods=["POST"])

    async def load(self, body: LoadLoRAAdapterBody) -> PlainTextResponse:
        if not body.lora_name or not body.lora_path:
            raise RequestError("lora_name and lora_path must not be empty", "lora_name")
        if body.lora_name == self.core.model_name:
            raise RequestError(f"lora_name {body.lora_name!r} is the base model's", "lora_name")
        message = worker_pb2.LoadLoRAAdapterRequest(
            lora_name=body.lora_name, lora_path=body.lora_path
        )
        await self._on_every_pod(
            lambda pod: pod.stub.LoadLoRAAdapter(message, timeout=ADMIN_TIMEOUT_S), "lora_path"
        )
        self.runtime_loras[body.lora_name] = body.lora_path
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    async def unload(self, body: UnloadLoRAAdapterBody) -> PlainTextResponse:
        name = body.lora_name
        if name not in self.core.served_models().adapters:
            message = f"LoRA adapter {name!r} is not loaded"
            raise RequestError(message, "lora_name", "model_not_found")
        message = worker_pb2.UnloadLoRAAdapterRequest(lora_name=name)
        holders = [pod for pod in self._pods() if name in pod.lora_adapters]
        await self._on_pods(
            holders,
            lambda pod: pod.stub.UnloadLoRAAdapter(message, timeout=ADMIN_TIMEOUT_S),
            "lora_name",
        )
        self.runtime_loras.pop(name, None)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    async def _give_runtime_loras(self, pod: Pod) -> None:
        """Loads on a pod that just came up the runtime adapters it lacks; a refusal is
        logged (routing keeps that adapter's requests on the pods that hold it)."""
        missing = {n: p for n, p in self.runtime_loras.items() if n not in pod.lora_adapters}
        for name, path in missing.items():
            message = worker_pb2.LoadLoRAAdapterRequest(lora_name=name, lora_path=path)
            try:
                await pod.stub.LoadLoRAAdapter(message, timeout=ADMIN_TIMEOUT_S)
            except grpc.aio.AioRpcError as error:
                logger.warning(
                    "pod %s refused LoRA adapter %r (%s): %s",
                    pod.address,
                    name,
                    error.code().name,
                    error.details(),
                )
            else:
                logger.info("pod %s: loaded runtime LoRA adapter %r", pod.address, name)

    def _pods(self) -> list[Pod]:
        return [pod for pool in self._pools() for pod in pool.available()]

    def _pools(self) -> list[PodPool]:
        core = self.core
        return [pool for pool in (core.decode_pool, core.prefill_pool) if pool is not None]

    async def _on_every_pod(self, call, param: str) -> None:
        pods = self._pods()
        if not pods:
            raise NoPodError()
        await self._on_pods(pods, call, param)

    async def _on_pods(self, pods: list[Pod], call, param: str) -> None:
        """`call(pod)` on each pod at once; the first failure (in pod order) is the answer,
        after every pool has been polled again. `param`: the field a refusal names."""
        results = await asyncio.gather(*(call(pod) for pod in pods), return_exceptions=True)
        await asyncio.gather(*(pool.poll() for pool in self._pools()))
        for pod, result in zip(pods, results, strict=True):
            if isinstance(result, grpc.aio.AioRpcError):
                raise _from_rpc_error(pod, result, param)
            if isinstance(result, BaseException):
                raise result


def _from_rpc_error(pod: Pod, error: grpc.aio.AioRpcError, param: str) -> Exception:
    detail = error.details() or str(error.code())
    if error.code() == grpc.StatusCode.INVALID_ARGUMENT:
        return RequestError(detail, param)
    if error.code() == grpc.StatusCode.NOT_FOUND:
        return RequestError(detail, "lora_name", "model_not_found")
    return StatusError(error.code(), f"pod {pod.address}: {detail}")
