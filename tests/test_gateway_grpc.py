"""The gRPC side end to end, on a stack started the way users start it: `splitserve up`
(gateway + one decode pod, colocated), stopped at the end with Ctrl-C (SIGINT).

Covers the public Generation service (unary, stream, INVALID_ARGUMENT), the internal
DecodeWorker (stats, abort, cancellation), the launcher's plan, and the proto <-> engine
conversions.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from splitserve.cli import build_parser
from splitserve.common.channels import sync_channel
from splitserve.common.cli_args import parse_size
from splitserve.common.convert import options_from_params, params_from_options
from splitserve.engine.sampling_params import SamplingParams
from splitserve.launcher import plan
from splitserve.v1 import generate_pb2, generate_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.services_util import (
    MODEL_NAME,
    free_port,
    is_port_open,
    post_raw,
    wait_until_idle,
)

STARTUP_TIMEOUT_SECONDS = 120.0
PROMPT = "The capital of France is"


@dataclass
class UpProcess:
    process: subprocess.Popen
    log: Path
    http_port: int
    grpc_port: int
    decode_port: int

    @property
    def decode_address(self) -> str:
        return f"127.0.0.1:{self.decode_port}"

    @property
    def ports(self) -> list[int]:
        return [self.http_port, self.grpc_port, self.decode_port]


def _start_up(log: Path) -> UpProcess:
    http_port, grpc_port, decode_port = free_port(), free_port(), free_port()
    argv = [sys.executable, "-m", "splitserve.cli", "up", "--colocated"]
    argv += ["--port", str(http_port), "--grpc-port", str(grpc_port)]
    argv += ["--decode-port", str(decode_port), "--kv-cache-bytes", "128MiB"]
    argv += ["--num-threads", "1"]
    with open(log, "wb") as out:
        process = subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    return UpProcess(process, log, http_port, grpc_port, decode_port)


def _wait_for_banner(up: UpProcess) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_SECONDS
    while "splitserve is up" not in up.log.read_text():
        assert up.process.poll() is None, f"splitserve up exited:\n{up.log.read_text()}"
        assert time.monotonic() < deadline, f"splitserve up never came up:\n{up.log.read_text()}"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def up(tmp_path_factory) -> UpProcess:
    up = _start_up(tmp_path_factory.mktemp("up") / "up.log")
    try:
        _wait_for_banner(up)
        yield up
    finally:
        if up.process.poll() is None:  # the Ctrl-C test did not run (or failed)
            os.kill(up.process.pid, signal.SIGINT)
            try:
                up.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(up.process.pid, signal.SIGKILL)  # its children die with it
                up.process.wait()


@pytest.fixture(scope="module")
def generation(up: UpProcess):
    with sync_channel(f"127.0.0.1:{up.grpc_port}") as channel:
        yield generate_pb2_grpc.GenerationStub(channel)


@pytest.fixture(scope="module")
def decode(up: UpProcess):
    with sync_channel(up.decode_address) as channel:
        yield worker_pb2_grpc.DecodeWorkerStub(channel)


def _greedy(max_tokens: int = 8, **extra) -> generate_pb2.SamplingOptions:
    return generate_pb2.SamplingOptions(max_tokens=max_tokens, temperature=0.0, **extra)


def _http_completion(up: UpProcess, body: dict) -> dict:
    result = post_raw(f"http://127.0.0.1:{up.http_port}/v1/completions", json.dumps(body).encode())
    assert result.status == 200, result.body
    return result.body


# ---- the public Generation service ---------------------------------------------------------


def test_generate_equals_the_http_api(up, generation):
    response = generation.Generate(
        generate_pb2.GenerateRequest(request_id="g-1", text=PROMPT, sampling=_greedy()),
        timeout=60,
    )
    http = _http_completion(
        up,
        {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "return_token_ids": True},
    )
    (sequence,) = response.sequences
    assert (response.request_id, response.model) == ("g-1", MODEL_NAME)
    assert list(sequence.token_ids) == http["choices"][0]["token_ids"]
    assert sequence.text == http["choices"][0]["text"]
    assert (sequence.index, sequence.finish_reason) == (0, "length")
    assert response.usage.prompt_tokens == http["usage"]["prompt_tokens"]
    assert response.usage.completion_tokens == 8


def test_generate_stream_deltas_add_up_to_the_unary_result(generation):
    request = generate_pb2.GenerateRequest(text=PROMPT, sampling=_greedy(max_tokens=10, logprobs=1))
    whole = generation.Generate(request, timeout=60).sequences[0]
    messages = list(generation.GenerateStream(request, timeout=60))
    assert len(messages) > 2
    deltas = [delta for message in messages for delta in message.deltas]
    assert "".join(delta.text for delta in deltas) == whole.text
    assert [t for delta in deltas for t in delta.token_ids] == list(whole.token_ids)
    assert [lp.token_id for delta in deltas for lp in delta.logprobs] == list(whole.token_ids)
    assert [delta.finish_reason for delta in deltas][-1] == "length"
    assert not any(delta.finish_reason for delta in deltas[:-1])
    # Only the very last message carries usage.
    assert [message.HasField("usage") for message in messages] == [False] * (len(messages) - 1) + [
        True
    ]
    assert messages[-1].usage.completion_tokens == 10
    assert messages[0].request_id.startswith("gen-")  # assigned by the gateway


def test_generate_n2_from_token_ids_and_chat(up, generation):
    ids = generate_pb2.TokenIds(ids=[504, 3458, 282, 4649, 314])
    # Greedy, so the two calls must agree token for token: seeded sampling draws the same random
    # numbers, but the two calls may batch differently, and CPU matmul kernels that differ by
    # batch shape can move a logit in its last bits, which now and then flips a sampled token.
    sampling = generate_pb2.SamplingOptions(n=2, max_tokens=5, temperature=0.0)
    request = generate_pb2.GenerateRequest(token_ids=ids, sampling=sampling)
    whole = generation.Generate(request, timeout=60)
    assert [sequence.index for sequence in whole.sequences] == [0, 1]
    streamed: dict[int, list[int]] = {0: [], 1: []}
    for message in generation.GenerateStream(request, timeout=60):
        for delta in message.deltas:
            streamed[delta.index].extend(delta.token_ids)
    assert streamed == {s.index: list(s.token_ids) for s in whole.sequences}
    assert whole.usage.prompt_tokens == 5  # counted once for both sequences

    messages = [generate_pb2.ChatMessage(role="user", content="What is 2+2?")]
    chat = generation.Generate(
        generate_pb2.GenerateRequest(
            chat=generate_pb2.ChatMessages(messages=messages), sampling=_greedy()
        ),
        timeout=60,
    )
    http = post_raw(
        f"http://127.0.0.1:{up.http_port}/v1/chat/completions",
        json.dumps(
            {
                "messages": [{"role": "user", "content": "What is 2+2?"}],
                "max_tokens": 8,
                "temperature": 0,
            }
        ).encode(),
    )
    assert chat.sequences[0].text == http.body["choices"][0]["message"]["content"]


def test_cancelling_a_generate_stream_frees_the_decode_blocks(up, generation):
    sampling = generate_pb2.SamplingOptions(max_tokens=1000, temperature=0.0, ignore_eos=True)
    stream = generation.GenerateStream(
        generate_pb2.GenerateRequest(text=PROMPT, sampling=sampling), timeout=60
    )
    for _ in range(3):
        next(stream)
    stream.cancel()
    stats = wait_until_idle(up.decode_address)
    assert (stats.num_running, stats.kv_blocks_free) == (0, stats.kv_blocks_total)


INVALID_REQUESTS = [
    generate_pb2.GenerateRequest(sampling=_greedy()),  # no prompt
    generate_pb2.GenerateRequest(text="", sampling=_greedy()),
    generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=[10**6])),
    generate_pb2.GenerateRequest(chat=generate_pb2.ChatMessages()),
    generate_pb2.GenerateRequest(text="hi", sampling=generate_pb2.SamplingOptions(n=0)),
    generate_pb2.GenerateRequest(
        text="hi", sampling=generate_pb2.SamplingOptions(temperature=-1.0)
    ),
    generate_pb2.GenerateRequest(text="hi", sampling=generate_pb2.SamplingOptions(top_p=2.0)),
    generate_pb2.GenerateRequest(
        text="hi", sampling=generate_pb2.SamplingOptions(max_tokens=100_000)
    ),
    generate_pb2.GenerateRequest(text="word " * 9000),
]


@pytest.mark.parametrize("request_", INVALID_REQUESTS, ids=range(len(INVALID_REQUESTS)))
def test_bad_requests_are_invalid_argument(generation, request_):
    with pytest.raises(grpc.RpcError) as unary:
        generation.Generate(request_, timeout=30)
    assert unary.value.code() == grpc.StatusCode.INVALID_ARGUMENT, unary.value.details()
    with pytest.raises(grpc.RpcError) as stream:
        list(generation.GenerateStream(request_, timeout=30))
    assert stream.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert stream.value.details() == unary.value.details()


def test_an_unknown_model_is_not_found(generation):
    # HTTP answers OpenAI's 404 model_not_found; gRPC's status for it is NOT_FOUND.
    request = generate_pb2.GenerateRequest(text="hi", model="gpt-4")
    with pytest.raises(grpc.RpcError) as unary:
        generation.Generate(request, timeout=30)
    assert unary.value.code() == grpc.StatusCode.NOT_FOUND, unary.value.details()
    assert "gpt-4" in unary.value.details()


# ---- the internal DecodeWorker -------------------------------------------------------------


def test_decode_worker_stats(decode):
    stats = decode.GetStats(worker_pb2.StatsRequest(), timeout=10)
    assert (stats.worker_id, stats.role, stats.model) == ("decode-0", "decode", MODEL_NAME)
    assert (stats.block_size, stats.vocab_size, stats.max_model_len) == (16, 49152, 8192)
    assert stats.kv_transport == "tcp"
    assert stats.kv_blocks_total > 0 and stats.kv_blocks_free == stats.kv_blocks_total
    assert stats.prefix_cache_queried_tokens > 0  # earlier tests' prompts were looked up


def test_decode_rejects_n_above_one(decode):
    request = worker_pb2.DecodeRequest(
        request_id="n2", prompt_token_ids=[1, 2, 3], sampling=generate_pb2.SamplingOptions(n=2)
    )
    with pytest.raises(grpc.RpcError) as info:
        list(decode.Decode(request, timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith("n must be 1")


def _long_decode(request_id: str) -> worker_pb2.DecodeRequest:
    sampling = generate_pb2.SamplingOptions(max_tokens=1000, temperature=0.0, ignore_eos=True)
    return worker_pb2.DecodeRequest(
        request_id=request_id, prompt_token_ids=list(range(100, 140)), sampling=sampling
    )


def test_abort_ends_a_running_decode(up, decode):
    assert not decode.Abort(worker_pb2.AbortRequest(request_id="nobody"), timeout=10).found
    stream = decode.Decode(_long_decode("to-abort"), timeout=60)
    first = next(stream)
    assert first.prefill_mode == "local" and len(first.token_ids) == 1
    assert decode.Abort(worker_pb2.AbortRequest(request_id="to-abort"), timeout=10).found
    last = list(stream)[-1]
    assert last.finish_reason == "abort"
    assert last.usage.prompt_tokens == 40
    stats = wait_until_idle(up.decode_address)
    assert stats.kv_blocks_free == stats.kv_blocks_total


def test_cancelling_a_decode_call_frees_its_blocks(up, decode):
    stream = decode.Decode(_long_decode("to-cancel"), timeout=60)
    for _ in range(3):
        next(stream)
    assert decode.GetStats(worker_pb2.StatsRequest(), timeout=10).num_running == 1
    stream.cancel()
    stats = wait_until_idle(up.decode_address)
    assert (stats.num_running, stats.kv_blocks_free) == (0, stats.kv_blocks_total)


def test_an_unreachable_prefill_pod_falls_back_to_local_prefill(decode):
    # Nothing listens at the named address: the decode pod prefills itself and says so. The
    # prompt is longer than the local-prefill threshold, so the remote path is really tried.
    request = worker_pb2.DecodeRequest(
        request_id="fallback",
        prompt_token_ids=list(range(20000, 20040)),  # no other test caches these
        sampling=_greedy(max_tokens=2),
        prefill_address="127.0.0.1:1",
    )
    responses = list(decode.Decode(request, timeout=30))
    assert {response.prefill_mode for response in responses} == {"local-fallback"}
    assert responses[-1].finish_reason == "length"


# ---- pieces without processes --------------------------------------------------------------


def test_sampling_options_round_trip_to_the_same_params():
    params = SamplingParams(
        n=3,
        max_tokens=7,
        temperature=0.7,
        top_p=0.9,
        top_k=5,
        min_p=0.05,
        seed=2**40,
        presence_penalty=0.1,
        frequency_penalty=-0.3,
        repetition_penalty=1.1,
        stop=("a", "bc"),
        stop_token_ids=(2, 3),
        ignore_eos=True,
        logprobs=3,
        min_tokens=2,
        skip_special_tokens=False,
    )
    # float32 on the wire, yet 0.7 / 0.9 / 1.1 arrive exactly as sent.
    assert params_from_options(options_from_params(params)) == params
    assert params_from_options(generate_pb2.SamplingOptions()) == SamplingParams()
    with pytest.raises(ValueError, match="^seed"):
        options_from_params(SamplingParams(seed=2**63))


def test_parse_size():
    assert [parse_size(s) for s in ("1024", "128MiB", "128Mi", "2GB", "1.5KiB")] == [
        1024,
        128 * 2**20,
        128 * 2**20,
        2 * 10**9,
        1536,
    ]


def _up_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["up", *argv])


def test_up_plans_colocated_until_a_prefill_service_exists():
    colocated = plan(_up_args("--decode", "2"), prefill_available=False)
    assert [spec.name for spec in colocated.specs] == ["decode-0", "decode-1", "gateway"]
    assert "services/prefill does not exist yet" in colocated.mode_note
    gateway_argv = colocated.specs[-1].argv
    assert "--prefill" not in gateway_argv
    assert gateway_argv.count("--decode") == 2

    split = plan(_up_args("--prefill", "2", "--transport", "ucx"), prefill_available=True)
    assert [spec.name for spec in split.specs] == ["prefill-0", "prefill-1", "decode-0", "gateway"]
    assert split.specs[-1].argv.count("--prefill") == 2
    decode_argv = split.specs[2].argv
    assert decode_argv[decode_argv.index("--kv-transport") + 1] == "ucx"

    assert "--prefill" not in plan(_up_args("--colocated"), True).specs[-1].argv


# ---- a crash, then Ctrl-C --------------------------------------------------------------------


def _pid_of_pod(port: int) -> int:
    """The pid of the decode pod serving `port` (its command line names the port)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as file:
                argv = file.read().split(b"\0")
        except OSError:
            continue
        if b"splitserve.decode" in argv and str(port).encode() in argv:
            return int(entry)
    raise AssertionError(f"no decode pod process on port {port}")


@pytest.mark.slow  # ~13 s; the fast suite measured 14:32 on a quiet evening
def test_up_restarts_a_killed_pod_and_serves_through_it_again(up, generation):
    request = generate_pb2.GenerateRequest(text=PROMPT, sampling=_greedy())
    before = generation.Generate(request, timeout=60)
    os.kill(_pid_of_pod(up.decode_port), signal.SIGKILL)
    deadline = time.monotonic() + STARTUP_TIMEOUT_SECONDS
    while "decode-0 restarted" not in up.log.read_text():
        assert time.monotonic() < deadline, up.log.read_text()
        time.sleep(0.2)
    assert "decode-0 exited with status" in up.log.read_text()
    while True:  # the restarted pod loads its model, then the gateway routes to it again
        try:
            after = generation.Generate(request, timeout=60)
            break
        except grpc.RpcError as error:
            assert error.code() == grpc.StatusCode.UNAVAILABLE, error
            assert time.monotonic() < deadline, up.log.read_text()
            time.sleep(0.5)
    assert up.process.poll() is None  # `up` itself kept running throughout
    assert after.sequences[0].token_ids == before.sequences[0].token_ids


def test_ctrl_c_stops_everything(up):
    log = up.log.read_text()
    assert f"http://127.0.0.1:{up.http_port}/v1" in log and "curl" in log
    assert all(is_port_open(port) for port in up.ports)
    os.kill(up.process.pid, signal.SIGINT)  # what Ctrl-C in its terminal sends
    assert up.process.wait(timeout=30) == 0
    assert "[up] stopped" in up.log.read_text()
    assert not any(is_port_open(port) for port in up.ports)  # no process left behind
