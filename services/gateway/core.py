"""The gateway's request core, shared by the HTTP and gRPC front ends: prompts tokenized as the
engine would, a request checked before anything is scheduled, and one DecodeRequest per sequence
(n > 1 and several prompts fanned out) sent to the pods the router picks. The front ends import
this module; it imports none of theirs (no HTTP schema, no proto of the public API).

The child ids and seeds come from `splitserve.engine.prompts.child_sequences`, the very function
the engine uses in-process, so a request served through the gateway samples what `LLM.generate`
would. What happens to the calls once sent (merged streams, resends, migration) is
`generation.py`'s."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import grpc

from splitserve.common import tracing
from splitserve.common.convert import options_from_params
from splitserve.common.grpc_server import StatusError
from splitserve.engine.params_check import check_params
from splitserve.engine.prompts import check_prompt, child_sequences
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.structured_output.grammar import GrammarError
from splitserve.engine.tokenizer import Tokenizer
from splitserve.gateway.admission.controller import (
    AdmissionAsk,
    AdmissionController,
    Ticket,
    pod_priority,
)
from splitserve.gateway.admission.slo import TPOT_HEADER, TTFT_HEADER, Slo
from splitserve.gateway.auth.gate import Caller, PendingCharge, current_caller
from splitserve.gateway.bounds import check_conversation, check_params_bounds, check_priority
from splitserve.gateway.errors import RequestError
from splitserve.gateway.generation import Generation, SequenceCall
from splitserve.gateway.metrics import GatewayMetrics, route_span
from splitserve.gateway.migration import MigrationPolicy
from splitserve.gateway.routing.pods import PodPool
from splitserve.gateway.routing.router import PickedPods, Router
from splitserve.v1 import worker_pb2


class NoPodError(StatusError):
    """No decode pod is reachable: HTTP 503 / gRPC UNAVAILABLE."""

    def __init__(self, message: str = "no decode pod is available") -> None:
        super().__init__(grpc.StatusCode.UNAVAILABLE, message)


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompts: list[list[int]]  # token ids; each prompt gets params.n sequences
    params: SamplingParams
    priority: int = 0
    # OpenAI's prompt_cache_key: requests sharing it are routed to the same decode pod.
    prompt_cache_key: str | None = None
    # The request field params.structured_output came from ("response_format", "tools", ...):
    # the 400 of a constraint that does not compile names it.
    structured_output_param: str = "structured_output"
    # The LoRA adapter the request's "model" named (ServedModels.lora_name); None: the base.
    lora_name: str | None = None


@dataclass(frozen=True)
class ServedModels:
    """What a request's "model" may name: the base model, or a LoRA adapter some pod holds."""

    base: str
    adapters: frozenset[str] = field(default_factory=frozenset)

    def lora_name(self, model: str | None) -> str | None:
        """The adapter `model` names; None for the base model (or no model given).
        RequestError (HTTP 404, code model_not_found) for a name served nowhere."""
        if model is None or model == self.base:
            return None
        if model in self.adapters:
            return model
        served = ", ".join(repr(name) for name in [self.base, *sorted(self.adapters)])
        raise RequestError(
            f"model {model!r} does not exist; this server serves {served}",
            "model",
            "model_not_found",
        )


def served_models(models: str | ServedModels) -> ServedModels:
    """A bare model name means a server without adapters."""
    return ServedModels(models) if isinstance(models, str) else models


class GatewayCore:
    def __init__(
        self,
        tokenizer: Tokenizer,
        model_name: str,
        decode_pool: PodPool,
        prefill_pool: PodPool | None = None,
        metrics: GatewayMetrics | None = None,
        router: Router | None = None,
        migration: MigrationPolicy | None = None,
        admission: AdmissionController | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        # SLO-aware admission and fair queues (services/gateway/admission/); None: every
        # request goes to the pods at once, as without --admission.
        self.admission = admission
        self.migration = migration or MigrationPolicy()
        self.model_name = model_name
        self.decode_pool = decode_pool
        self.prefill_pool = prefill_pool
        self.metrics = metrics or GatewayMetrics()
        # Picks the pods of every sequence (services/gateway/routing/router.py); without one
        # given, static pods by load and proximity.
        self.router = router or Router(decode_pool, prefill_pool)

    def served_models(self) -> ServedModels:
        """The base model and every adapter an available decode pod holds (from its stats)."""
        return ServedModels(self.model_name, frozenset(self.decode_pool.lora_adapters()))

    # ---- prompts ----------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """As `LLM.generate` tokenizes a text prompt (with the model's BOS/EOS rules)."""
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def encode_chat(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> list[int]:
        """As `LLM.chat` does: the chat template, then tokens without extra specials."""
        check_conversation(messages)
        text = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt
        )
        return self.tokenizer.encode(text, add_special_tokens=False)

    @property
    def max_model_len(self) -> int:
        max_model_len = self.decode_pool.max_model_len
        if max_model_len is None:
            raise NoPodError()
        return max_model_len

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raises PromptError / ValueError (naming the parameter) for a request no pod can
        serve, NoPodError when there is no pod to ask."""
        max_model_len = self.max_model_len
        # The engine's own check, less the KV cache's size, which only the pod knows.
        check_prompt(prompt_token_ids, self.tokenizer.vocab_size, max_model_len)
        num_tokens = len(prompt_token_ids)
        if num_tokens + params.max_tokens > max_model_len:
            raise ValueError(
                f"max_tokens is too large: {num_tokens} prompt tokens + {params.max_tokens} "
                f"max_tokens exceed this model's context length of {max_model_len}"
            )

    def _check_params(self, request: GenerationRequest) -> None:
        """The engine's own check of what the parameters ask of the model (logit_bias ids in
        the vocabulary, a structured output that compiles), before anything is scheduled. The
        one place the gateway compiles a request's grammar: a 400 names the field it came
        from."""
        check_params_bounds(request.params)
        check_priority(request.priority)
        try:
            check_params(request.params, self.tokenizer.vocab_size)
        except GrammarError as error:
            param = request.structured_output_param
            message = str(error).removeprefix("structured_output ")
            raise RequestError(f"{param}: {message}", param) from None

    # ---- requests ---------------------------------------------------------------------------

    async def start(
        self, request: GenerationRequest, client_region: str = "", slo: Slo | None = None
    ) -> Generation:
        """Validates every prompt, then sends every sequence to the pods the router picks
        (`client_region`: the client's region, from `x-splitserve-region`, "" if unknown).
        A request of an authenticated caller (auth/gate.py) is charged to its tenant's
        limits (LimitExceeded past one: from here, or from the generation before its first
        output when the tenant had room enough for the check to run beside the routing and
        prefill, auth/headroom.py) and carries its tenant's cache salt. With
        admission control on, the request may wait for room first, or be refused
        (AdmissionRefused): `slo` is what its headers asked for, over its tenant's and the
        gateway's defaults."""
        tracing.current_span().set_attribute(tracing.REQUEST_ID, request.request_id)
        self._check_params(request)
        for prompt in request.prompts:
            self.validate(prompt, request.params)
        caller = current_caller()
        charge = None
        if caller is not None:  # its tenant's limits, and its cache salt
            request, charge = caller.charge_soon(request)
            if not charge.may_overlap:  # near its limits: nothing is sent before the check
                await charge.wait()
        try:
            generation = await self._admit_and_dispatch(request, caller, charge, slo, client_region)
        except BaseException:
            if charge is not None:  # its slot known before the error answers
                await charge.settle()
            raise
        if charge is not None and charge.may_overlap:
            generation.wait_before_first_output(charge.wait)
        return generation

    async def _admit_and_dispatch(
        self,
        request: GenerationRequest,
        caller: Caller | None,
        charge: PendingCharge | None,
        slo: Slo | None,
        region: str,
    ) -> Generation:
        ticket = await self._admit(request, caller, slo or Slo())
        favoured = ticket is not None and ticket.favoured
        try:
            if charge is not None and charge.refused:  # refused while it waited for room
                await charge.wait()
            if ticket is not None:  # the pods order their queues by it (controller.py)
                priority = pod_priority(request.priority, favoured)
                request = replace(request, priority=priority)
            generation = await self._dispatch(request, region, favoured)
        except BaseException:
            self._release(ticket, None)
            raise
        if ticket is not None and self.admission is not None:
            generation.on_end = lambda ended: self._release(ticket, ended)
            admission = self.admission
            generation.on_first_token = lambda ttft_s: admission.first_token(ticket, ttft_s)
        return generation

    async def _dispatch(
        self, request: GenerationRequest, client_region: str, favoured: bool = False
    ) -> Generation:
        """Routes and sends every sequence of `request` (`favoured`: admission control sends
        it ahead of other tenants' work)."""
        with route_span(self.metrics) as observe:
            calls = [
                await self._call(
                    request,
                    prompt_index,
                    sequence_index,
                    child_id,
                    child_params,
                    client_region,
                    favoured,
                )
                for prompt_index, prompt_id in enumerate(_prompt_ids(request))
                for sequence_index, (child_id, child_params) in enumerate(
                    child_sequences(prompt_id, request.params)
                )
            ]
            observe([(call.decision, len(call.request.prompt_token_ids)) for call in calls])
        num_prompt_tokens = sum(len(prompt) for prompt in request.prompts)
        return Generation(
            calls,
            num_prompt_tokens,
            self.metrics,
            self._reroute,
            self.decode_pool.mark_unreachable,
            self.migration,
        )

    async def _admit(
        self, request: GenerationRequest, caller: Caller | None, slo: Slo
    ) -> Ticket | None:
        """Waits for admission control's leave (None without admission control: then an SLO
        asked for is a 400 naming its header, not a response that ignored it)."""
        if self.admission is None:
            if slo.binds:
                header = TTFT_HEADER if slo.ttft_ms is not None else TPOT_HEADER
                raise RequestError(
                    f"{header}: this gateway runs without admission control (--admission), "
                    "so it cannot honour an SLO",
                    header,
                )
            return None
        tenant_slo = caller.key.slo if caller is not None else Slo()
        ask = AdmissionAsk(
            request_id=request.request_id,
            tenant=caller.tenant if caller is not None else "",
            priority=request.priority,
            slo=slo.over(tenant_slo).over(self.admission.settings.slo),
            num_sequences=len(request.prompts) * request.params.n,
            num_prompt_tokens=max(len(prompt) for prompt in request.prompts),
            max_tokens=request.params.max_tokens,
        )
        return await self.admission.admit(ask)

    def _release(self, ticket: Ticket | None, generation: Generation | None) -> None:
        if ticket is None or self.admission is None:
            return
        if generation is None:
            self.admission.release(ticket, None, None)
        else:
            self.admission.release(ticket, generation.ttft_s, generation.tpot_s)

    async def _call(
        self,
        request: GenerationRequest,
        prompt_index: int,
        sequence_index: int,
        child_id: str,
        child_params: SamplingParams,
        client_region: str,
        favoured: bool = False,
    ) -> SequenceCall:
        picked = await self.router.pick(
            request.prompts[prompt_index],
            client_region,
            cache_salt=child_params.cache_salt,
            cache_key=request.prompt_cache_key,
            lora_name=request.lora_name,
        )
        if picked is None:
            raise NoPodError()
        decode_request = worker_pb2.DecodeRequest(
            request_id=child_id,
            prompt_token_ids=request.prompts[prompt_index],
            sampling=options_from_params(child_params),
            priority=request.priority,
            prefill_address=picked.prefill.address if picked.prefill is not None else "",
            lora_name=request.lora_name or "",
        )
        index = prompt_index * request.params.n + sequence_index
        return SequenceCall(
            index,
            prompt_index,
            decode_request,
            picked.decode,
            picked.decision,
            client_region=client_region,
            cache_salt=child_params.cache_salt,
            favoured=favoured,
            prefill_pod=picked.prefill,
        )

    async def _reroute(self, call: SequenceCall) -> PickedPods | None:
        """The pods for a sequence whose decode pod was unreachable: the decode pods it failed
        on are left out, and so are its failed attempts' prefill pods while others remain."""
        prompt = list(call.request.prompt_token_ids)
        return await self.router.pick(
            prompt,
            call.client_region,
            exclude=call.failed_addresses,
            avoid_prefill=call.earlier_prefill_addresses,
            cache_salt=call.cache_salt,
            lora_name=call.request.lora_name or None,
        )


def _prompt_ids(request: GenerationRequest) -> list[str]:
    if len(request.prompts) == 1:
        return [request.request_id]
    return [f"{request.request_id}-{i}" for i in range(len(request.prompts))]
