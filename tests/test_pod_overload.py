"""A decode pod under load, with real processes: it reports its fitted step costs and its
queued prompt tokens in GetStats, refuses (RESOURCE_EXHAUSTED) a request past its
--max-waiting-requests bound before any work, and the gateway serves a refused request on
another pod, or answers 429 when every pod refuses.

Two decode pods serving the tiny random checkpoint, each running one request at a time
(--max-num-seqs 1) and letting one more wait (--max-waiting-requests 1), and a gateway routing
round robin over them. A pod is filled by hand: one endless request (max_tokens far past what
a test waits for, cancelled at the end) runs, a second waits behind it; from then on the pod
refuses whatever would wait, until the test cancels them. Nothing waits on a timing: the
states are polled for, and the fillers hold them for as long as the test needs.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from email.message import Message

import grpc
import pytest

from splitserve.cli import build_parser
from splitserve.common.channels import sync_channel
from splitserve.common.convert import options_from_params
from splitserve.common.step_costs import StepCosts
from splitserve.decode.overload import OverloadBound, PodRoom, refusal
from splitserve.engine.core import EngineStats
from splitserve.engine.sampling_params import SamplingParams
from splitserve.gateway.admission.feedback import TokenGaps
from splitserve.gateway.api.respond import error_response
from splitserve.gateway.generation import Generation, PodError, PodRefused, SequenceCall, collect
from splitserve.gateway.metrics import GatewayMetrics
from splitserve.gateway.migration import MigrationPolicy
from splitserve.gateway.routing.router import PickedPods
from splitserve.gateway.routing.scoring import RoutingDecision
from splitserve.launcher import plan
from splitserve.pod.metrics import PodMetrics
from splitserve.v1 import generate_pb2, generate_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.services_util import Stack, decode_stats, get_json, start_stack, wait_until_idle

# Far more tokens than a test lives for (the tiny model takes milliseconds a step).
ENDLESS = SamplingParams(temperature=0.0, max_tokens=20000, ignore_eos=True)
SHORT = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
WAITING_PROMPT = list(range(100, 140))  # the waiting filler's 40 prompt tokens
POLL_TIMEOUT_S = 20.0


@pytest.fixture(scope="module")
def stack(tiny_hf_checkpoint: str) -> Iterator[Stack]:
    decode_flags = ["--model", tiny_hf_checkpoint, "--kv-cache-bytes", "16MiB"]
    decode_flags += ["--max-num-seqs", "1", "--max-waiting-requests", "1"]
    gateway_flags = ["--model", tiny_hf_checkpoint, "--routing-policy", "round_robin"]
    started = start_stack(num_decode=2, decode_flags=decode_flags, gateway_flags=gateway_flags)
    try:
        yield started.wait_healthy()
    finally:
        started.stop()


@dataclass
class Filled:
    """A pod with one request running and one waiting (`calls`, cancelled by `release`)."""

    address: str
    channel: grpc.Channel
    calls: list

    def release(self) -> worker_pb2.WorkerStats:
        """Cancels the fillers; the pod's stats once it is idle again."""
        for call in self.calls:
            call.cancel()
        self.channel.close()
        return wait_until_idle(self.address)


def _decode_request(request_id: str, prompt: list[int], params: SamplingParams):
    return worker_pb2.DecodeRequest(
        request_id=request_id, prompt_token_ids=prompt, sampling=options_from_params(params)
    )


def _fill(address: str, name: str) -> Filled:
    """One endless request running on the pod at `address`, and one waiting behind it."""
    channel = sync_channel(address)
    stub = worker_pb2_grpc.DecodeWorkerStub(channel)
    running = stub.Decode(_decode_request(f"{name}-running", [5, 6, 7, 8], ENDLESS))
    next(running)  # its first token: it holds the pod's one batch slot
    waiting = stub.Decode(_decode_request(f"{name}-waiting", WAITING_PROMPT, ENDLESS))
    filled = Filled(address, channel, [running, waiting])
    _poll(lambda: decode_stats(address).num_waiting == 1, f"{name}'s second request waits")
    return filled


def _poll(condition, what: str) -> None:
    deadline = time.monotonic() + POLL_TIMEOUT_S
    while not condition():
        assert time.monotonic() < deadline, f"never saw: {what}"
        time.sleep(0.05)


def _decode_once(address: str, request_id: str) -> list[int]:
    """A short request straight to the pod; its tokens (raises grpc.RpcError if refused)."""
    with sync_channel(address) as channel:
        stub = worker_pb2_grpc.DecodeWorkerStub(channel)
        responses = stub.Decode(_decode_request(request_id, [9, 10, 11], SHORT), timeout=30)
        return [token for response in responses for token in response.token_ids]


def _complete(stack: Stack, model: str) -> tuple[int, Message, dict]:
    """A short completion through the gateway: status, headers (any case), body."""
    body = {"model": model, "prompt": "Hello there", "max_tokens": 4, "ignore_eos": True}
    request = urllib.request.Request(
        f"{stack.base_url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.headers, json.load(response)
    except urllib.error.HTTPError as error:
        return error.code, error.headers, json.load(error)


def _refusals(stack: Stack, outcome: str) -> float:
    with urllib.request.urlopen(f"{stack.base_url}/metrics", timeout=10) as response:
        text = response.read().decode()
    prefix = f'splitserve:pod_refusals_total{{outcome="{outcome}"}} '
    lines = [line for line in text.splitlines() if line.startswith(prefix)]
    return float(lines[0].removeprefix(prefix)) if lines else 0.0


def _room(num_running: int, num_queued: int, num_free_blocks: int, num_unseen: int = 0) -> PodRoom:
    """A pod of 100 blocks of 16 tokens and 4 batch slots."""
    stats = EngineStats(
        num_running, num_queued, 100, num_free_blocks, 0, 0, 0, num_waiting_for_admission=num_queued
    )
    return PodRoom(stats, num_unseen, block_size=16, max_num_seqs=4)


def test_the_rule_refuses_only_what_would_wait_past_the_bound():
    bound = OverloadBound(max_waiting_requests=2)
    assert refusal(OverloadBound(), _room(4, 50, 0), 64) is None  # no bound: everything queues
    assert refusal(bound, _room(4, 1, 0), 64) is None  # one waits: room for another
    message = refusal(bound, _room(4, 2, 0), 64)
    assert message is not None and "--max-waiting-requests 2" in message
    assert "2 requests are queued ahead of it" in message
    # Calls on their way to the engine count as waiting, but a request that can start at once
    # (a slot, and blocks beside the running requests' next ones) is always taken.
    assert refusal(bound, _room(1, 0, 50, num_unseen=2), 64) is None
    full_batch = refusal(bound, _room(4, 0, 50, num_unseen=2), 64)
    assert full_batch is not None and "the running batch is full" in full_batch
    # 5 blocks of prompt; 7 free, but 3 are kept for the 3 running requests' next tokens.
    no_blocks = refusal(bound, _room(3, 0, 7, num_unseen=2), 5 * 16)
    assert no_blocks is not None and "5 KV blocks exceed the 4 free blocks" in no_blocks
    # In 2 layer groups (shared/kv/groups.py) a position's block is a block in each group,
    # and each running request keeps one in each: 10 blocks, 15 free less 6 kept.
    assert refusal(bound, _room(3, 0, 15, num_unseen=2), 5 * 16) is None
    stats = _room(3, 0, 15).stats
    grouped = refusal(bound, PodRoom(stats, 2, 16, 4, kv_groups=2), 5 * 16)
    assert grouped is not None and "10 KV blocks exceed the 9 free blocks" in grouped
    assert refusal(bound, _room(3, 0, 8, num_unseen=2), 5 * 16) is None


def test_the_pod_counts_its_refusals_and_shows_its_queued_prompt_tokens():
    stats = EngineStats(1, 2, 100, 50, 0, 0, 0, num_waiting_prompt_tokens=300)
    metrics = PodMetrics("decode", "m", lambda: stats)
    metrics.observe_refused()
    labels = {"model_name": "m", "role": "decode"}
    value = metrics.registry.get_sample_value
    assert value("splitserve:refused_requests_total", labels) == 1
    assert value("splitserve:num_waiting_prompt_tokens", labels) == 300


def test_up_passes_the_bound_to_decode_and_colocated_pods_only():
    for mode in ([], ["--colocated"]):
        args = build_parser().parse_args(["up", "--max-waiting-requests", "3", *mode])
        specs = {spec.name: spec.argv for spec in plan(args, prefill_available=True).specs}
        decode = specs["decode-0"]
        assert decode[decode.index("--max-waiting-requests") + 1] == "3"
        assert all(
            "--max-waiting-requests" not in specs[name] for name in specs if name != "decode-0"
        )
    default = plan(build_parser().parse_args(["up"]), prefill_available=True)
    assert all("--max-waiting-requests" not in spec.argv for spec in default.specs)
    with pytest.raises(ValueError, match="--max-waiting-requests must be >= 0"):
        plan(build_parser().parse_args(["up", "--max-waiting-requests", "-1"]), True)


# ---- the gateway's side, in this process: decode pods that answer from a script ----------


class _ScriptedCall:
    """A decode call that streams `responses` and then fails with `error` (None: ends)."""

    def __init__(self, responses: list, error: grpc.StatusCode | None) -> None:
        self._responses, self._error = responses, error

    def __aiter__(self):
        return self._stream()

    async def _stream(self):
        for response in self._responses:
            yield response
        if self._error is not None:
            metadata = grpc.aio.Metadata()
            raise grpc.aio.AioRpcError(self._error, metadata, metadata, self._error.name)

    def cancel(self) -> bool:
        return True


@dataclass
class _ScriptedPod:
    """Duck-types the routing Pod a Generation calls: every call on it follows the script."""

    address: str
    responses: list
    error: grpc.StatusCode | None = None
    requests: list = field(default_factory=list)
    call_breakers: set = field(default_factory=set)
    awaiting_prompt_tokens: int = 0  # what admission control reads of a pod
    token_gaps: TokenGaps = field(default_factory=TokenGaps)

    @property
    def decode_stub(self):
        return self

    def Decode(self, request, metadata=None) -> _ScriptedCall:  # noqa: N802 (the stub's name)
        self.requests.append(worker_pb2.DecodeRequest(request_id=request.request_id))
        self.requests[-1].CopyFrom(request)
        return _ScriptedCall(self.responses, self.error)


def _tokens(*token_ids: int, finish: bool = False) -> worker_pb2.DecodeResponse:
    response = worker_pb2.DecodeResponse(token_ids=token_ids)
    if finish:
        response.finish_reason = "length"
    return response


def _run(pods: list[_ScriptedPod]) -> tuple[list[int], GatewayMetrics, list[str], Exception | None]:
    """One sequence through a Generation that first calls pods[0] and reroutes to the others
    in order: its tokens, the metrics, the pods marked unreachable, and the error it ended
    with (None: it finished)."""
    metrics, unreachable = GatewayMetrics(), []
    decision = RoutingDecision(pods[0].address, pods[0].address, None, None, "round_robin", {}, 0)

    async def reroute(call: SequenceCall) -> PickedPods | None:
        left = [pod for pod in pods if pod.address not in call.failed_addresses]
        return PickedPods(decision, left[0], None) if left else None  # type: ignore[arg-type]

    async def run() -> tuple[list[int], Exception | None]:
        request = worker_pb2.DecodeRequest(request_id="r", prompt_token_ids=[1, 2, 3])
        child = SequenceCall(0, 0, request, pods[0], decision)  # type: ignore[arg-type]
        mark_unreachable = lambda pod: unreachable.append(pod.address)  # noqa: E731
        generation = Generation([child], 3, metrics, reroute, mark_unreachable, MigrationPolicy())
        try:
            sequences = await collect(generation)
        except PodError as error:
            return [], error
        return sequences[0].token_ids, None

    token_ids, error = asyncio.run(run())
    return token_ids, metrics, unreachable, error


def _count(metrics: GatewayMetrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


def test_a_refusal_before_output_is_rerouted_without_a_cooldown():
    full = _ScriptedPod("full:1", [], grpc.StatusCode.RESOURCE_EXHAUSTED)
    free = _ScriptedPod("free:1", [_tokens(7), _tokens(8, finish=True)])
    token_ids, metrics, unreachable, error = _run([full, free])
    assert (token_ids, error, unreachable) == ([7, 8], None, [])
    assert _count(metrics, "splitserve:pod_refusals_total", outcome="rerouted") == 1
    assert _count(metrics, "splitserve:routing_retries_total") == 0  # that counts the gone


def test_a_pod_a_broken_stream_migrates_to_may_refuse_and_the_move_goes_on():
    broken = _ScriptedPod("broken:1", [_tokens(7)], grpc.StatusCode.UNAVAILABLE)
    full = _ScriptedPod("full:1", [], grpc.StatusCode.RESOURCE_EXHAUSTED)
    free = _ScriptedPod("free:1", [_tokens(8, finish=True)])
    token_ids, metrics, unreachable, error = _run([broken, full, free])
    assert (token_ids, error, unreachable) == ([7, 8], None, ["broken:1"])
    assert list(free.requests[0].resumed_output_token_ids) == [7]
    assert _count(metrics, "splitserve:pod_refusals_total", outcome="rerouted") == 1


def test_when_every_pod_refuses_the_client_is_told_to_come_back():
    pods = [_ScriptedPod(f"full:{i}", [], grpc.StatusCode.RESOURCE_EXHAUSTED) for i in range(2)]
    _, metrics, unreachable, error = _run(pods)
    assert isinstance(error, PodRefused) and unreachable == []
    assert error.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert error.retry_after == {"Retry-After": "1"}
    assert error_response(error)[0] == 429
    assert _count(metrics, "splitserve:pod_refusals_total", outcome="returned") == 1


def test_stats_report_fitted_step_costs_and_queued_prompt_tokens(stack: Stack):
    address = stack.decode_addresses[0]
    assert _decode_once(address, "warm-up")  # steps to fit
    filled = _fill(address, "stats")
    try:
        # The running filler steps on: the fit has its steps soon, whatever the machine's pace.
        _poll(lambda: StepCosts.from_proto(decode_stats(address)).is_known, "fitted costs")
        stats = decode_stats(address)
        # The waiting request's prompt, all of it uncomputed; the running one only decodes.
        assert stats.num_waiting_prompt_tokens == len(WAITING_PROMPT)
        costs = StepCosts.from_proto(stats)
        assert costs.is_known and costs.step_ms(1) > 0  # a decode step costs something
        assert min(costs.step_row_ms, costs.step_prefill_token_ms) >= 0
        assert (costs.max_num_seqs, costs.max_num_batched_tokens) == (1, 512)
    finally:
        idle = filled.release()
    assert idle.num_waiting_prompt_tokens == 0


def test_a_full_pod_refuses_before_any_work_and_keeps_no_block(stack: Stack):
    address = stack.decode_addresses[0]
    filled = _fill(address, "refuse")
    try:
        with pytest.raises(grpc.RpcError) as refused:
            _decode_once(address, "refused")
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-waiting-requests 1" in refused.value.details()
        stats = decode_stats(address)
        assert (stats.num_running, stats.num_waiting) == (1, 1)  # nothing of it stayed
    finally:
        idle = filled.release()
    assert (idle.num_running, idle.num_waiting) == (0, 0)
    assert idle.kv_blocks_free == idle.kv_blocks_total
    assert _decode_once(address, "refused")  # its id was never taken: it runs now


def test_the_gateway_reroutes_a_refusal_and_answers_429_when_every_pod_refuses(stack: Stack):
    model = get_json(f"{stack.base_url}/v1/models").body["data"][0]["id"]
    first = _fill(stack.decode_addresses[0], "gateway-0")
    second = None
    try:
        rerouted_before = _refusals(stack, "rerouted")
        # Round robin sends one of two requests to the full pod first; it refuses, and the
        # other pod serves it.
        for _ in range(2):
            status, _, body = _complete(stack, model)
            assert status == 200, body
            assert len(body["choices"][0]["text"]) > 0
        assert _refusals(stack, "rerouted") > rerouted_before
        second = _fill(stack.decode_addresses[1], "gateway-1")
        returned_before = _refusals(stack, "returned")
        status, headers, body = _complete(stack, model)
        assert status == 429, body
        assert headers.get("Retry-After") == "1"
        assert body["error"]["code"] == "resource_exhausted"
        assert "overloaded" in body["error"]["message"]
        assert _refusals(stack, "returned") == returned_before + 1
        with sync_channel(stack.grpc_address) as channel:  # gRPC clients hear the same
            request = generate_pb2.GenerateRequest(
                model=model, text="Hello", sampling=options_from_params(SHORT)
            )
            with pytest.raises(grpc.RpcError) as refused:
                generate_pb2_grpc.GenerationStub(channel).Generate(request, timeout=30)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert dict(refused.value.trailing_metadata())["retry-after"] == "1"
    finally:
        for filled in (first, second):
            if filled is not None:
                idle = filled.release()
                assert idle.kv_blocks_free == idle.kv_blocks_total
