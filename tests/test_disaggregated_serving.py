"""Disaggregated serving end to end: a gateway, one prefill pod and one decode pod (separate
processes, real gRPC), once with KV pages over UCX on loopback and once over plain TCP, every
page buffer CRC-32 checked. Driven with the official `openai` client and with direct gRPC.

The reference is the offline engine (`LLM`) in this process, with the pods' settings: what
comes back must be what one engine doing both phases produces, token for token.

How a request was prefilled shows in two places: every DecodeResponse carries `prefill_mode`
(checked with direct calls to the decode pod), and the prefill pod's prefix-cache lookups count
exactly the prompt tokens it was given (checked for requests through the gateway, whose OpenAI
responses stay plain OpenAI).
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import signal
import time
import zlib

import grpc
import pytest
import torch
from openai import AsyncOpenAI, OpenAI

from splitserve import LLM, SamplingParams
from splitserve.cli import build_parser
from splitserve.common.channels import sync_channel
from splitserve.common.convert import options_from_params
from splitserve.engine.kv.transfer import KVTransferDescriptor
from splitserve.engine.outputs import CompletionOutput
from splitserve.engine.structured_output.spec import StructuredOutput
from splitserve.launcher import plan
from splitserve.prefill.core import CHECKSUM_ALGORITHM, first_token_params
from splitserve.prefill.servicer import descriptor_to_proto
from splitserve.v1 import generate_pb2, worker_pb2, worker_pb2_grpc
from tests.services_util import (
    MODEL_NAME,
    Stack,
    prefill_stats,
    start_stack,
    wait_until_idle,
)

# UCX stacks take ~20 s more to start than TCP ones: their end-to-end runs are in make test-slow;
# make test keeps UCX itself through tests/test_kv_transfer.py.
TRANSPORTS = (pytest.param("ucx", marks=pytest.mark.slow), "tcp")
THRESHOLD = 32  # the decode pod's default --local-prefill-threshold
TEXTS = [
    "The lighthouse keeper climbed the narrow spiral stairs every evening at dusk, lit the "
    "great lamp, and wrote in his logbook about the ships that passed. One stormy night,",
    "Here is a Python function that parses a comma-separated list of integers, skips blank "
    "entries, and returns their sum:\n\ndef parse_and_sum(text):\n",
    "Photosynthesis is how green plants, algae and some bacteria turn sunlight, water and "
    "carbon dioxide into sugar and oxygen. Explained to a ten-year-old, it goes like this:",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=8, logprobs=2)


def tagged(tag: str, count: int = len(TEXTS)) -> list[str]:
    """Prompts no earlier test sent (a different first block), so the decode pod's prefix
    cache holds none of them and they go to the prefill pod."""
    return [f"[{tag} {i}] {TEXTS[i % len(TEXTS)]}" for i in range(count)]


@pytest.fixture(scope="module")
def stacks():
    """A stack per transport, started when a test first asks for it: make test selects TCP only."""
    started: dict[str, Stack] = {}

    def stack_for(transport: str) -> Stack:
        if transport not in started:
            started[transport] = start_stack(
                num_prefill=1, transport=transport, prefill_flags=["--kv-checksum", "--nice", "5"]
            )
        return started[transport]

    try:
        yield stack_for
    finally:
        for stack in started.values():
            stack.stop()


@pytest.fixture(scope="module")
def llm(stacks) -> LLM:
    """Built while the pods start; single-threaded as they are."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield LLM(kv_cache_bytes=128 * 2**20)
    torch.set_num_threads(previous)


@pytest.fixture(scope="module", params=TRANSPORTS)
def stack(request, stacks) -> Stack:
    return stacks(request.param).wait_healthy()


@pytest.fixture(scope="module")
def client(stack: Stack) -> OpenAI:
    return OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def decode(stack: Stack):
    with sync_channel(stack.decode_addresses[0]) as channel:
        yield worker_pb2_grpc.DecodeWorkerStub(channel)


_references: dict[tuple[str, SamplingParams], CompletionOutput] = {}


def expected(llm: LLM, prompts: list[str], params: SamplingParams) -> list[CompletionOutput]:
    """The offline engine's outputs, computed once per prompt for both transports."""
    missing = [p for p in prompts if (p, params) not in _references]
    if missing:
        for prompt, output in zip(missing, llm.generate(missing, params)):
            _references[prompt, params] = output.outputs[0]
    return [_references[p, params] for p in prompts]


def queried_tokens(stack: Stack) -> int:
    return prefill_stats(stack.prefill_addresses[0]).prefix_cache_queried_tokens


def num_prompt_tokens(llm: LLM, prompts: list[str]) -> int:
    return sum(len(llm.tokenizer.encode(prompt)) for prompt in prompts)


def assert_both_pods_idle(stack: Stack) -> None:
    for address, role in [(stack.decode_addresses[0], "decode"), *prefill_pods(stack)]:
        stats = wait_until_idle(address, role=role)
        assert (stats.num_running, stats.num_waiting) == (0, 0), role
        assert stats.kv_blocks_free == stats.kv_blocks_total, role


def prefill_pods(stack: Stack) -> list[tuple[str, str]]:
    if stack.processes["prefill-0"].poll() is not None:  # killed by the last test
        return []
    return [(stack.prefill_addresses[0], "prefill")]


def decode_request(
    request_id: str, prompt_token_ids: list[int], params: SamplingParams, prefill_address: str
) -> worker_pb2.DecodeRequest:
    sampling = generate_pb2.SamplingOptions(
        max_tokens=params.max_tokens, temperature=params.temperature, top_p=params.top_p
    )
    if params.seed is not None:
        sampling.seed = params.seed
    if params.logprobs is not None:
        sampling.logprobs = params.logprobs
    return worker_pb2.DecodeRequest(
        request_id=request_id,
        prompt_token_ids=prompt_token_ids,
        sampling=sampling,
        prefill_address=prefill_address,
    )


def _token_ids(choice) -> list[int]:
    return choice.model_extra["token_ids"]  # vLLM's return_token_ids extension


# ---- through the gateway --------------------------------------------------------------------


def test_greedy_completions_are_remote_and_equal_the_offline_engine(stack, client, llm):
    prompts = tagged("greedy")
    assert all(len(llm.tokenizer.encode(p)) >= THRESHOLD for p in prompts)
    before = queried_tokens(stack)
    for prompt, want in zip(prompts, expected(llm, prompts, GREEDY)):
        got = client.completions.create(
            model=MODEL_NAME,
            prompt=prompt,
            max_tokens=8,
            temperature=0,
            extra_body={"return_token_ids": True},
        )
        (choice,) = got.choices
        assert _token_ids(choice) == want.token_ids
        assert choice.text == want.text
        assert choice.finish_reason == "length"
    # The prefill pod looked up exactly these prompts: it prefilled every one of them.
    assert queried_tokens(stack) - before == num_prompt_tokens(llm, prompts)
    assert_both_pods_idle(stack)


def test_streamed_chunks_add_up_to_the_offline_engine_text(stack, client, llm):
    (prompt,) = tagged("stream", 1)
    (want,) = expected(llm, [prompt], GREEDY)
    before = queried_tokens(stack)
    chunks = list(
        client.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=8, temperature=0, stream=True
        )
    )
    assert len(chunks) > 2
    assert "".join(chunk.choices[0].text for chunk in chunks) == want.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert queried_tokens(stack) - before == num_prompt_tokens(llm, [prompt])


def test_eight_concurrent_requests_all_complete_correctly(stack, llm):
    prompts = tagged("concurrent", 8)
    wants = expected(llm, prompts, GREEDY)
    before = queried_tokens(stack)

    async def run() -> list:
        client = AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0)
        async with client:
            return await asyncio.gather(
                *(
                    client.completions.create(
                        model=MODEL_NAME,
                        prompt=prompt,
                        max_tokens=8,
                        temperature=0,
                        extra_body={"return_token_ids": True},
                        timeout=120,
                    )
                    for prompt in prompts
                )
            )

    results = asyncio.run(run())
    assert [_token_ids(r.choices[0]) for r in results] == [w.token_ids for w in wants]
    assert queried_tokens(stack) - before == num_prompt_tokens(llm, prompts)
    assert_both_pods_idle(stack)


def test_client_disconnect_mid_stream_frees_the_blocks_on_both_pods(stack, client, llm):
    (prompt,) = tagged("disconnect", 1)
    before = queried_tokens(stack)
    stream = client.completions.create(
        model=MODEL_NAME,
        prompt=prompt,
        max_tokens=1000,  # a minute of decoding, unless the disconnect aborts it
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    assert queried_tokens(stack) - before == num_prompt_tokens(llm, [prompt])  # went remote
    assert_both_pods_idle(stack)


# ---- straight to the decode pod -------------------------------------------------------------


def test_decode_responses_say_how_the_prompt_was_prefilled(stack, decode, llm):
    prefill_address = stack.prefill_addresses[0]
    (prompt,) = tagged("modes", 1)
    prompt_ids = llm.tokenizer.encode(prompt)
    (want,) = expected(llm, [prompt], SEEDED)

    remote = list(decode.Decode(decode_request("m-1", prompt_ids, SEEDED, prefill_address)))
    assert {r.prefill_mode for r in remote} == {"remote"}
    assert [t for r in remote for t in r.token_ids] == want.token_ids
    # The first token's logprobs came from the prefill pod, through the proto and back.
    logprobs = [lp for r in remote for lp in r.logprobs]
    assert [(lp.token_id, lp.rank) for lp in logprobs] == [
        (lp.token_id, lp.rank) for lp in want.logprobs
    ]
    assert [[t.token_id for t in lp.top] for lp in logprobs] == [
        [token_id for token_id, _ in lp.top] for lp in want.logprobs
    ]
    assert [lp.logprob for lp in logprobs] == pytest.approx(
        [lp.logprob for lp in want.logprobs], abs=1e-4
    )

    # Again: the decode pod now holds all but the prompt's last partial block itself, fewer
    # uncached tokens than the threshold, so it prefills them locally.
    again = list(decode.Decode(decode_request("m-2", prompt_ids, SEEDED, prefill_address)))
    assert {r.prefill_mode for r in again} == {"local"}
    assert [t for r in again for t in r.token_ids] == want.token_ids

    short_ids = llm.tokenizer.encode("Water boils at")
    assert len(short_ids) < THRESHOLD
    before = queried_tokens(stack)
    short = list(decode.Decode(decode_request("m-3", short_ids, GREEDY, prefill_address)))
    assert {r.prefill_mode for r in short} == {"local"}
    assert [t for r in short for t in r.token_ids] == expected(llm, ["Water boils at"], GREEDY)[
        0
    ].token_ids
    assert queried_tokens(stack) == before  # the prefill pod never saw it


def test_structured_output_holds_across_the_prefill_and_decode_pods(stack, decode, llm):
    """The prefill pod samples the first token under the grammar, the decode pod's grammar
    state starts after it: the result equals one engine's, greedy and seeded."""
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 10}, "rank": {"enum": [1, 2]}},
        "required": ["city", "rank"],
        "additionalProperties": False,
    }
    output = StructuredOutput.json_schema(schema)
    prompts = tagged("json", 2)
    for i, params in enumerate(
        [
            SamplingParams(temperature=0.0, max_tokens=30, structured_output=output),
            SamplingParams(temperature=0.9, seed=5, max_tokens=30, structured_output=output),
        ]
    ):
        (want,) = expected(llm, [prompts[i]], params)
        assert want.text.startswith('{"city": ') and want.finish_reason == "stop", want.text
        request = worker_pb2.DecodeRequest(
            request_id=f"json-{i}",
            prompt_token_ids=llm.tokenizer.encode(prompts[i]),
            sampling=options_from_params(params),
            prefill_address=stack.prefill_addresses[0],
        )
        responses = list(decode.Decode(request))
        assert {r.prefill_mode for r in responses} == {"remote"}
        assert [t for r in responses for t in r.token_ids] == want.token_ids
    assert_both_pods_idle(stack)


def test_cancel_and_abort_mid_prefill_end_the_requests_on_both_pods(stack, decode, llm):
    """One call is cancelled (its client went away), one is aborted through the Abort RPC,
    both while their prompts are with the prefill pod (three 512-token chunks of work each)."""
    prefill_address = stack.prefill_addresses[0]
    params = SamplingParams(temperature=0.0, max_tokens=4)
    cancelled = decode.Decode(
        decode_request("c-1", list(range(1000, 2100)), params, prefill_address), timeout=60
    )
    aborted = decode.Decode(
        decode_request("a-1", list(range(3000, 4100)), params, prefill_address), timeout=60
    )
    deadline = time.monotonic() + 30
    while prefill_stats(prefill_address).num_running == 0:
        assert time.monotonic() < deadline, "the prefill pod never started the prompts"
        time.sleep(0.02)
    cancelled.cancel()
    assert decode.Abort(worker_pb2.AbortRequest(request_id="a-1"), timeout=10).found
    with pytest.raises(grpc.RpcError) as info:
        list(cancelled)
    assert info.value.code() == grpc.StatusCode.CANCELLED
    responses = list(aborted)
    assert [r.finish_reason for r in responses] == ["abort"]
    assert responses[-1].usage.completion_tokens == 0
    assert_both_pods_idle(stack)

    # Both pods and the KV connection between them still serve remote prefills.
    (prompt,) = tagged("after-cancel", 1)
    prompt_ids = llm.tokenizer.encode(prompt)
    after = list(decode.Decode(decode_request("c-2", prompt_ids, GREEDY, prefill_address)))
    assert {r.prefill_mode for r in after} == {"remote"}
    assert [t for r in after for t in r.token_ids] == expected(llm, [prompt], GREEDY)[0].token_ids


# ---- last for each transport: the prefill pod dies ------------------------------------------


def test_a_prefill_pod_started_with_nice_runs_at_that_niceness(stack):
    # The fixture starts the prefill pod with --nice 5; this process runs at its own niceness.
    prefill = stack.processes["prefill-0"].pid
    own = os.getpriority(os.PRIO_PROCESS, 0)
    assert os.getpriority(os.PRIO_PROCESS, prefill) == min(19, own + 5)
    assert os.getpriority(os.PRIO_PROCESS, stack.processes["decode-0"].pid) == own


def test_a_killed_prefill_pod_leaves_requests_to_local_prefill(stack, client, decode, llm):
    os.kill(stack.processes["prefill-0"].pid, signal.SIGKILL)
    stack.processes["prefill-0"].wait(timeout=10)
    prompts = tagged("killed", 2)
    wants = expected(llm, prompts, GREEDY)

    # Named explicitly, the dead pod is tried, fails, and the decode pod prefills instead.
    prompt_ids = llm.tokenizer.encode(prompts[0])
    request = decode_request("k-1", prompt_ids, GREEDY, stack.prefill_addresses[0])
    responses = list(decode.Decode(request, timeout=60))
    assert {r.prefill_mode for r in responses} == {"local-fallback"}
    assert [t for r in responses for t in r.token_ids] == wants[0].token_ids

    # Through the gateway (which soon stops naming the dead pod) requests still complete.
    got = client.completions.create(
        model=MODEL_NAME,
        prompt=prompts[1],
        max_tokens=8,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    assert _token_ids(got.choices[0]) == wants[1].token_ids
    assert_both_pods_idle(stack)


# ---- pieces without processes ---------------------------------------------------------------


def test_up_runs_one_prefill_and_one_decode_pod_by_default():
    default = plan(build_parser().parse_args(["up"]), prefill_available=True)
    assert [spec.name for spec in default.specs] == ["prefill-0", "decode-0", "gateway"]
    transport = "ucx" if importlib.util.find_spec("ucxx") is not None else "tcp"
    assert f"KV over {transport}" in default.mode_note
    cores = os.cpu_count() or 1
    for spec in default.specs[:2]:
        assert _flag(spec.argv, "--kv-transport") == transport
    # Decode: every core (its tuner picks 1 or all per step); prefill: its share of the cores.
    assert _flag(default.specs[0].argv, "--num-threads") == str(max(1, cores // 2))
    assert _flag(default.specs[1].argv, "--num-threads") == str(cores)
    assert _flag(default.specs[1].argv, "--local-prefill-threshold") == str(THRESHOLD)
    # The decode pod leaves the prefill pod its threads while it computes a prompt of ours.
    assert _flag(default.specs[1].argv, "--neighbor-prefill-threads") == str(max(1, cores // 2))
    fixed = plan(build_parser().parse_args(["up", "--num-threads", "1"]), prefill_available=True)
    assert "--neighbor-prefill-threads" not in fixed.specs[1].argv  # no tuner to tell
    # Conditional disaggregation off by default here: on shared cores a decode process
    # prefilling itself adds no compute and stalls its streams; the flag turns it on.
    assert _flag(default.specs[1].argv, "--max-remote-prefill-tokens") == "0"
    limited = plan(build_parser().parse_args(["up", "--max-remote-prefill-tokens", "256"]), True)
    assert _flag(limited.specs[1].argv, "--max-remote-prefill-tokens") == "256"
    with pytest.raises(ValueError, match="--max-remote-prefill-tokens must be >= 0"):
        plan(build_parser().parse_args(["up", "--max-remote-prefill-tokens", "-1"]), True)
    # Prefill runs at the decode pods' priority unless told to yield the shared cores.
    assert _flag(default.specs[0].argv, "--nice") == "0"
    assert "--nice" not in default.specs[1].argv
    args = build_parser().parse_args(["up", "--prefill-nice", "10"])
    assert _flag(plan(args, prefill_available=True).specs[0].argv, "--nice") == "10"
    with pytest.raises(ValueError, match="--prefill-nice must be within 0..19, got 20"):
        plan(build_parser().parse_args(["up", "--prefill-nice", "20"]), prefill_available=True)
    assert _flag(default.specs[2].argv, "--prefill") == "127.0.0.1:50071"
    # The host KV tier is on by default, sized once for both pods; no disk tier unless asked.
    host_tiers = {_flag(spec.argv, "--kv-offload-host-bytes") for spec in default.specs[:2]}
    assert len(host_tiers) == 1 and int(host_tiers.pop()) > 0
    assert "--kv-offload-disk-dir" not in default.specs[0].argv

    args = ["up", "--kv-offload-host-bytes", "0", "--kv-offload-disk-dir", "/tmp/kv"]
    with_disk = plan(build_parser().parse_args(args), prefill_available=True)
    assert _flag(with_disk.specs[1].argv, "--kv-offload-host-bytes") == "0"
    # Each pod its own directory: a restarted pod finds its blocks (a warm restart).
    assert _flag(with_disk.specs[0].argv, "--kv-offload-disk-dir") == "/tmp/kv/prefill-0"
    assert _flag(with_disk.specs[1].argv, "--kv-offload-disk-dir") == "/tmp/kv/decode-0"
    assert _flag(with_disk.specs[1].argv, "--kv-offload-disk-bytes") == str(2**30)

    colocated = plan(build_parser().parse_args(["up", "--colocated"]), prefill_available=True)
    assert [spec.name for spec in colocated.specs] == ["decode-0", "gateway"]
    assert "--prefill" not in colocated.specs[1].argv
    assert "--local-prefill-threshold" not in colocated.specs[0].argv
    assert "--max-remote-prefill-tokens" not in colocated.specs[0].argv


def test_up_passes_the_prefill_cap_beside_decodes_to_the_decode_pods_only():
    default = plan(build_parser().parse_args(["up"]), prefill_available=True)
    assert all("--max-prefill-tokens-while-decoding" not in s.argv for s in default.specs)
    args = build_parser().parse_args(["up", "--max-prefill-tokens-while-decoding", "64"])
    capped = plan(args, prefill_available=True)
    assert "--max-prefill-tokens-while-decoding" not in capped.specs[0].argv  # prefill pod
    assert _flag(capped.specs[1].argv, "--max-prefill-tokens-while-decoding") == "64"
    flag = "--max-prefill-tokens-while-decoding"
    args = build_parser().parse_args(["up", "--colocated", flag, "64"])
    assert _flag(plan(args, True).specs[0].argv, flag) == "64"
    with pytest.raises(ValueError, match="must be >= 1, got 0"):
        args = build_parser().parse_args(["up", "--max-prefill-tokens-while-decoding", "0"])
        plan(args, prefill_available=True)


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_a_prefill_pod_samples_only_the_first_token_as_the_request_would():
    params = SamplingParams(n=3, max_tokens=50, min_tokens=5, seed=9, temperature=0.7, logprobs=1)
    first = first_token_params(params)
    assert (first.n, first.max_tokens, first.min_tokens) == (1, 1, 1)  # EOS still suppressed
    assert (first.seed, first.temperature, first.logprobs) == (9, 0.7, 1)
    assert first_token_params(SamplingParams(max_tokens=4)).min_tokens == 0


def test_transfer_descriptors_travel_with_their_crc32():
    pages = torch.arange(2 * 30 * 2 * 16 * 3 * 64, dtype=torch.float32).reshape(2, 30, 2, 16, 3, 64)
    descriptor = KVTransferDescriptor.for_buffer("r-1", [7, 3], pages, CHECKSUM_ALGORITHM)
    proto = descriptor_to_proto(descriptor)
    assert list(proto.block_ids) == [7, 3]
    layout = [proto.num_layers, proto.block_size, proto.num_kv_heads, proto.head_dim]
    assert layout == [30, 16, 3, 64]
    assert (proto.dtype, proto.num_bytes) == ("float32", pages.numel() * 4)
    assert proto.checksum == zlib.crc32(pages.numpy().tobytes()) != 0
    unchecked = KVTransferDescriptor.for_buffer("r-2", [7, 3], pages)
    assert descriptor_to_proto(unchecked).checksum == 0
