"""`--kv-cache-dtype int8` across real pods (separate processes, real gRPC, KV pages over TCP):
a decode pod and a prefill pod both int8 serve a remotely prefilled request exactly as the
offline int8 engine does; a prefill pod whose pages are int8 and a decode pod whose cache is
not refuse each other's pages, and the decode pod prefills the request itself."""

from __future__ import annotations

import pytest
import torch

from splitserve import LLM, SamplingParams
from splitserve.common.channels import sync_channel
from splitserve.v1 import worker_pb2_grpc
from tests.services_util import start_stack
from tests.test_disaggregated_serving import decode_request

pytestmark = pytest.mark.slow  # four pods and two engines of the shipped model

INT8 = ["--kv-cache-dtype", "int8"]
PROMPT = (
    "The lighthouse keeper climbed the narrow spiral stairs every evening at dusk, lit the "
    "great lamp, and wrote in his logbook about the ships that passed. One stormy night,"
)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


@pytest.fixture(scope="module")
def stacks():
    started = {}
    try:  # both start now, so their model loads overlap
        started["int8"] = start_stack(num_prefill=1, decode_flags=INT8, prefill_flags=INT8)
        started["mismatch"] = start_stack(num_prefill=1, prefill_flags=INT8)
        yield {name: stack.wait_healthy() for name, stack in started.items()}
    finally:
        for stack in started.values():
            stack.stop()


@pytest.fixture(scope="module")
def references(stacks) -> dict[str, LLM]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield {kv: LLM(kv_cache_bytes=128 * 2**20, kv_cache_dtype=kv) for kv in ("auto", "int8")}
    torch.set_num_threads(previous)


def _decode(stack, request_id: str, prompt_ids: list[int]):
    with sync_channel(stack.decode_addresses[0]) as channel:
        stub = worker_pb2_grpc.DecodeWorkerStub(channel)
        request = decode_request(request_id, prompt_ids, GREEDY, stack.prefill_addresses[0])
        return list(stub.Decode(request))


def test_int8_pods_serve_a_remote_prefill_as_the_offline_int8_engine(stacks, references):
    llm = references["int8"]
    prompt_ids = llm.tokenizer.encode(PROMPT)
    responses = _decode(stacks["int8"], "int8-1", prompt_ids)
    assert {r.prefill_mode for r in responses} == {"remote"}  # the int8 pages travelled
    want = llm.generate([prompt_ids], GREEDY)[0].outputs[0].token_ids
    assert [t for r in responses for t in r.token_ids] == want


def test_pods_of_different_kv_cache_dtypes_refuse_the_pages(stacks, references):
    llm = references["auto"]
    prompt_ids = llm.tokenizer.encode(PROMPT)
    responses = _decode(stacks["mismatch"], "mismatch-1", prompt_ids)
    # The decode pod (auto) refused the int8 pages and prefilled the prompt itself.
    assert {r.prefill_mode for r in responses} == {"local-fallback"}
    want = llm.generate([prompt_ids], GREEDY)[0].outputs[0].token_ids
    assert [t for r in responses for t in r.token_ids] == want
