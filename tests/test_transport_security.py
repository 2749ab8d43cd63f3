"""Security between the parts, with the real things: gRPC servers over TLS and mutual TLS (a
throwaway CA made here), a real pod process serving TLS only, the TCP KV transport proving a
per-deployment secret, and a real redis-server with requirepass.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import redis
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitserve.common import redis_auth
from splitserve.common.channels import aio_channel, sync_channel
from splitserve.common.grpc_server import start_server
from splitserve.common.ports import free_port
from splitserve.common.redis_server import RedisServer
from splitserve.common.registry_schema import connect
from splitserve.common.supervisor import HealthCheck, ProcessSpec, Supervisor
from splitserve.common.tls import TlsFiles
from splitserve.engine.kv.transfer import (
    KVTransferConfig,
    KVTransferDescriptor,
    KVTransferError,
    create_kv_transport,
)
from splitserve.engine.kv.transfer.peer_auth import NONCE_BYTES
from splitserve.v1 import worker_pb2_grpc

from .services_util import MODEL_NAME
from .tls_certs import issue, make_ca

SERVICE = "splitserve.v1.DecodeWorker"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    directory = tmp_path_factory.mktemp("pki")
    ca = make_ca(directory)
    other_ca = make_ca(directory, "other-ca")
    return {
        "ca": ca,
        "server": issue(ca, directory, "pod", ("splitserve-pod", "localhost")),
        "client": issue(ca, directory, "gateway"),
        "stranger": issue(other_ca, directory, "stranger"),
        "dir": directory,
    }


# ---- gRPC: one real server, clients with and without the right certificates ------------------


async def _check(address: str, channel: grpc.aio.Channel, service: str = "") -> int:
    async with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        return reply.status


async def _with_server(tls: TlsFiles | None, test, health_port: int = 0) -> None:
    server = await start_server("127.0.0.1", 0, [SERVICE], lambda _: None, tls, health_port)
    await server.set_serving(True)
    try:
        await test(f"127.0.0.1:{server.port}")
    finally:
        await server.stop(0)


def _plaintext(address: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(address)


def _code(error: pytest.ExceptionInfo[grpc.aio.AioRpcError]) -> grpc.StatusCode:
    return error.value.code()


def test_tls_server_refuses_plaintext_and_serves_tls(pki) -> None:
    server_tls = TlsFiles(pki["server"].cert, pki["server"].key)  # server-only TLS

    async def test(address: str) -> None:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await _check(address, _plaintext(address))
        assert _code(refused) == grpc.StatusCode.UNAVAILABLE
        # A client that trusts the CA but presents no certificate: fine without mutual TLS.
        trusting = grpc.ssl_channel_credentials(root_certificates=Path(pki["ca"].path).read_bytes())
        assert await _check(address, grpc.aio.secure_channel(address, trusting)) == SERVING
        assert await _check(address, aio_channel(address, pki["client"])) == SERVING

    asyncio.run(_with_server(server_tls, test))


def test_mutual_tls_refuses_clients_without_a_certificate_from_the_ca(pki) -> None:
    ca_pem = Path(pki["ca"].path).read_bytes()

    async def test(address: str) -> None:
        no_cert = grpc.ssl_channel_credentials(root_certificates=ca_pem)
        stranger: TlsFiles = pki["stranger"]
        foreign_cert = grpc.ssl_channel_credentials(
            root_certificates=ca_pem,  # trusts our server, presents another CA's certificate
            private_key=Path(stranger.key).read_bytes(),
            certificate_chain=Path(stranger.cert).read_bytes(),
        )
        for credentials in (no_cert, foreign_cert):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await _check(address, grpc.aio.secure_channel(address, credentials))
            assert _code(refused) == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await _check(address, _plaintext(address))
        assert _code(refused) == grpc.StatusCode.UNAVAILABLE
        assert await _check(address, aio_channel(address, pki["client"])) == SERVING

    asyncio.run(_with_server(pki["server"], test))


def test_client_refuses_a_server_the_ca_did_not_sign(pki) -> None:
    async def test(address: str) -> None:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await _check(address, aio_channel(address, pki["client"]))
        assert _code(refused) == grpc.StatusCode.UNAVAILABLE

    stranger: TlsFiles = pki["stranger"]
    asyncio.run(_with_server(TlsFiles(stranger.cert, stranger.key), test))


def test_server_name_override_checks_the_fixed_name_not_the_dialled_host(pki) -> None:
    client: TlsFiles = pki["client"]
    right = TlsFiles(client.cert, client.key, client.ca, server_name="splitserve-pod")
    wrong = TlsFiles(client.cert, client.key, client.ca, server_name="somebody-else")

    async def test(address: str) -> None:
        assert await _check(address, aio_channel(address, right)) == SERVING
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await _check(address, aio_channel(address, wrong))
        assert _code(refused) == grpc.StatusCode.UNAVAILABLE

    asyncio.run(_with_server(pki["server"], test))


def test_plaintext_health_port_answers_health_only(pki) -> None:
    health_port = free_port()

    async def test(address: str) -> None:
        plain = f"127.0.0.1:{health_port}"
        assert await _check(plain, _plaintext(plain), SERVICE) == SERVING
        async with _plaintext(plain) as channel:
            stub = worker_pb2_grpc.DecodeWorkerStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.GetStats(_stats_request(), timeout=5)
            assert _code(refused) == grpc.StatusCode.UNIMPLEMENTED

    asyncio.run(_with_server(pki["server"], test, health_port))


def _stats_request():
    from splitserve.v1 import worker_pb2

    return worker_pb2.StatsRequest()


def test_real_pod_serves_tls_only(pki, tmp_path: Path) -> None:
    """A decode pod started as the chart starts it: plaintext is refused on its gRPC port
    (before and after the model loads), a mutual-TLS client is answered."""
    port = free_port()
    address = f"127.0.0.1:{port}"
    server: TlsFiles = pki["server"]
    argv = [sys.executable, "-m", "splitserve.decode", "--host", "127.0.0.1"]
    argv += ["--port", str(port), "--kv-transport", "tcp", "--kv-cache-bytes", "64MiB"]
    argv += ["--num-threads", "1", "--log-level", "warning"]
    argv += ["--tls-cert", server.cert, "--tls-key", server.key, "--tls-ca", str(server.ca)]
    health = HealthCheck(grpc_address=address, grpc_service=SERVICE, tls=pki["client"])
    with Supervisor() as supervisor:
        supervisor.start(ProcessSpec("decode-tls", argv, health))
        supervisor.wait_healthy(120.0)
        with sync_channel(address) as channel:  # no TLS files given: plaintext
            stub = health_pb2_grpc.HealthStub(channel)
            with pytest.raises(grpc.RpcError) as refused:
                stub.Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=5)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


# ---- the TCP KV transport with a per-deployment secret ---------------------------------------

SECRET = b"0123456789abcdef-deployment-secret"


def _config(secret: bytes | None) -> KVTransferConfig:
    return KVTransferConfig(
        backend="tcp", offer_wait_s=2.0, connect_timeout_s=1.0, auth_secret=secret
    )


def _pages(seed: int) -> torch.Tensor:
    return torch.randn((3, 2, 2, 16, 2, 8), generator=torch.Generator().manual_seed(seed))


async def _transfer(receiver_secret: bytes | None, sender_secret: bytes | None) -> torch.Tensor:
    """One transfer; returns what landed in the destination."""
    receiver = await create_kv_transport(_config(receiver_secret)).start_receiver()
    sender = create_kv_transport(_config(sender_secret)).create_sender()
    pages = _pages(1)
    destination = torch.zeros_like(pages)
    descriptor = KVTransferDescriptor.for_buffer("r1", [0, 1, 2], pages, "crc32")
    try:
        receiving = asyncio.ensure_future(receiver.receive("r1", destination, timeout=3.0))
        await asyncio.sleep(0)
        await sender.send(receiver.address, descriptor, pages, timeout=3.0)
        await receiving
        return destination
    finally:
        await sender.close()
        await receiver.close()


def test_kv_transfer_with_the_shared_secret_delivers_the_pages() -> None:
    landed = asyncio.run(_transfer(SECRET, SECRET))
    assert torch.equal(landed, _pages(1))


@pytest.mark.parametrize("sender_secret", [None, b"not-the-deployment-secret-at-all"])
def test_kv_receiver_refuses_a_sender_without_the_secret(sender_secret) -> None:
    with pytest.raises(KVTransferError):
        asyncio.run(_transfer(SECRET, sender_secret))


def test_kv_sender_refuses_a_receiver_without_the_secret() -> None:
    """An impostor listening where a decode pod was: the sender pushes no page to it."""
    with pytest.raises(KVTransferError, match="authenticating|secret"):
        asyncio.run(_transfer(b"an-impostor-guessing-a-secret", SECRET))


def test_kv_receiver_closes_on_a_raw_peer_that_sends_junk() -> None:
    async def run() -> bytes:
        receiver = await create_kv_transport(_config(SECRET)).start_receiver()
        host, port = receiver.address.removeprefix("tcp://").rsplit(":", 1)
        try:
            reader, writer = await asyncio.open_connection(host, int(port))
            nonce = await reader.readexactly(NONCE_BYTES)
            writer.write(b"\x00" * 64 + b'{"type": "offer"}')
            await writer.drain()
            rest = await asyncio.wait_for(reader.read(), 5.0)  # b"" once it is closed
            writer.close()
            return nonce + rest
        finally:
            await receiver.close()

    answer = asyncio.run(run())
    assert len(answer) == NONCE_BYTES  # the nonce, then nothing: closed without an answer


def _flip_first_byte_in_transit(monkeypatch) -> None:
    """An attacker on the pod network rewriting one byte of every payload a sender puts on the
    wire (the sender's own tensor stays intact)."""
    from splitserve.engine.kv.transfer.tcp import TcpChannel

    original = TcpChannel.send_payload

    async def tampered(self, data: memoryview) -> None:
        altered = bytearray(data)
        altered[0] ^= 0xFF
        await original(self, memoryview(altered))

    monkeypatch.setattr(TcpChannel, "send_payload", tampered)


async def _unchecked_transfers(
    secret: bytes | None, request_ids: list[str], checksum: str | None = None
) -> list[object]:
    """Transfers on one connection (no checksum unless `checksum` names one); each outcome
    (the landed pages, or the receiver's error). A request id starting with "unposted" gets no
    receive: refused."""
    receiver = await create_kv_transport(_config(secret)).start_receiver()
    sender = create_kv_transport(_config(secret)).create_sender()
    outcomes: list[object] = []
    try:
        for seed, request_id in enumerate(request_ids):
            pages = _pages(seed)
            destination = torch.zeros_like(pages)
            descriptor = KVTransferDescriptor.for_buffer(request_id, [0, 1, 2], pages, checksum)
            receiving = None
            if not request_id.startswith("unposted"):
                receiving = asyncio.ensure_future(
                    receiver.receive(request_id, destination, timeout=3.0))  # fmt: skip
            await asyncio.sleep(0)
            try:
                await sender.send(receiver.address, descriptor, pages, timeout=3.0)
                assert receiving is not None
                await receiving
                outcomes.append(destination)
            except KVTransferError as error:
                if receiving is not None:
                    with contextlib.suppress(KVTransferError):
                        await receiving
                outcomes.append(error)
        return outcomes
    finally:
        await sender.close()
        await receiver.close()


def test_pages_altered_in_transit_are_refused_on_a_secret_connection(monkeypatch) -> None:
    """Every transfer on a connection whose ends proved the secret is MACed under that
    connection's key: a rewritten byte fails the transfer (no checksum was asked for)."""
    _flip_first_byte_in_transit(monkeypatch)
    [outcome] = asyncio.run(_unchecked_transfers(SECRET, ["r1"]))
    assert isinstance(outcome, KVTransferError) and "MAC" in str(outcome)


def test_without_a_secret_the_same_alteration_lands_unnoticed(monkeypatch) -> None:
    """The control: what the MAC catches above, nothing else catches here."""
    _flip_first_byte_in_transit(monkeypatch)
    [landed] = asyncio.run(_unchecked_transfers(None, ["r1"]))
    assert isinstance(landed, torch.Tensor) and not torch.equal(landed, _pages(0))


def test_maced_transfers_stay_in_step_across_a_refused_offer() -> None:
    """Both ends number the offers on a connection (the MAC covers the number, so a transfer
    cannot be replayed or reordered): a refused offer counts on both sides, and the
    transfers after it still verify."""
    outcomes = asyncio.run(_unchecked_transfers(SECRET, ["r1", "unposted", "r2", "r3"]))
    assert isinstance(outcomes[1], KVTransferError)
    for seed in (0, 2, 3):
        assert torch.equal(outcomes[seed], _pages(seed))  # type: ignore[arg-type]


def test_a_checksum_failure_leaves_the_maced_connection_in_step(monkeypatch) -> None:
    """The receiver reads the MAC that follows a payload before its checks can fail: a
    transfer refused for its checksum leaves the next one on the same connection intact."""
    from splitserve.engine.kv.transfer.tcp import TcpChannel

    original = TcpChannel.send_payload
    sends = []

    async def tamper_first(self, data: memoryview) -> None:
        sends.append(1)
        if len(sends) == 1:
            altered = bytearray(data)
            altered[0] ^= 0xFF
            data = memoryview(altered)
        await original(self, data)

    monkeypatch.setattr(TcpChannel, "send_payload", tamper_first)
    first, second = asyncio.run(_unchecked_transfers(SECRET, ["r1", "r2"], "crc32"))
    assert isinstance(first, KVTransferError) and "checksum" in str(first)
    assert isinstance(second, torch.Tensor) and torch.equal(second, _pages(1))


def test_a_transfer_whose_mac_is_wrong_is_failed_not_stored() -> None:
    """A peer that passed the handshake (it holds the secret) but sends a MAC that is not the
    pages' under this connection's key: the receiver answers done with an error, and the
    waiting receive fails instead of handing the pages on."""
    from splitserve.engine.kv.transfer.peer_auth import prove_to_server

    async def frame(send, message: dict[str, object]) -> None:
        data = json.dumps(message).encode()
        await send(len(data).to_bytes(4, "big") + data)

    async def run() -> tuple[dict[str, object], BaseException | None]:
        receiver = await create_kv_transport(_config(SECRET)).start_receiver()
        host, port = receiver.address.removeprefix("tcp://").rsplit(":", 1)
        pages = _pages(0)
        receiving = asyncio.ensure_future(
            receiver.receive("r1", torch.zeros_like(pages), timeout=3.0))  # fmt: skip
        try:
            reader, writer = await asyncio.open_connection(host, int(port))

            async def send(data: bytes) -> None:
                writer.write(data)
                await writer.drain()

            async def reply() -> dict[str, object]:
                length = int.from_bytes(await reader.readexactly(4), "big")
                return json.loads(await reader.readexactly(length))

            await prove_to_server(SECRET, send, reader.readexactly)
            descriptor = KVTransferDescriptor.for_buffer("r1", [0, 1, 2], pages)
            await frame(send, {"type": "offer", "descriptor": descriptor.to_json()})
            assert (await reply())["type"] == "ready"
            await send(pages.numpy().tobytes())
            await frame(send, {"type": "mac", "mac": "00" * 16})
            done = await reply()
            writer.close()
            outcome = await asyncio.gather(receiving, return_exceptions=True)
            return done, outcome[0] if isinstance(outcome[0], BaseException) else None
        finally:
            receiving.cancel()
            await receiver.close()

    done, error = asyncio.run(run())
    assert done["type"] == "done" and not done["ok"] and "MAC" in str(done["error"])
    assert isinstance(error, KVTransferError)


def test_kv_secret_is_not_in_the_config_repr() -> None:
    assert SECRET.decode() not in repr(_config(SECRET))


def test_ucx_with_a_secret_is_refused_rather_than_pretending() -> None:
    with pytest.raises(ValueError, match="NetworkPolicy"):
        KVTransferConfig(backend="ucx", auth_secret=SECRET)


# ---- Redis with AUTH --------------------------------------------------------------------------

REDIS_PASSWORD = 'p@ss "word" with spaces'


@pytest.fixture
def redis_with_password() -> Iterator[RedisServer]:
    with RedisServer(password=REDIS_PASSWORD) as server:
        yield server
    redis_auth.use_redis_password_file(None)


def test_redis_with_requirepass_refuses_us_without_the_password(redis_with_password) -> None:
    client = redis.Redis.from_url(redis_with_password.url, socket_timeout=2)
    with pytest.raises(redis.AuthenticationError):
        client.ping()

    async def ping() -> None:
        async with connect(redis_with_password.url, timeout_s=2.0) as client:
            await client.ping()

    redis_auth.use_redis_password_file(None)
    with pytest.raises(redis.AuthenticationError):
        asyncio.run(ping())


def test_redis_password_file_lets_our_client_in(redis_with_password, tmp_path: Path) -> None:
    wrong = tmp_path / "wrong"
    wrong.write_text("guess\n")
    redis_auth.use_redis_password_file(str(wrong))

    async def ping() -> bool:
        async with connect(redis_with_password.url, timeout_s=2.0) as client:
            return bool(await client.ping())

    with pytest.raises(redis.AuthenticationError):
        asyncio.run(ping())
    right = tmp_path / "password"
    right.write_text(REDIS_PASSWORD + "\n")  # a trailing newline, as `kubectl create` leaves
    redis_auth.use_redis_password_file(str(right))
    assert asyncio.run(ping())


def test_redis_password_file_errors_name_the_flag(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.write_text("\n")
    for path in (str(empty), str(tmp_path / "missing")):
        with pytest.raises(ValueError, match="--redis-password-file"):
            redis_auth.use_redis_password_file(path)


def test_redis_server_password_is_not_on_its_command_line(redis_with_password) -> None:
    with contextlib.suppress(FileNotFoundError):
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            with contextlib.suppress(OSError):
                argv = (proc / "cmdline").read_bytes()
                if f"{redis_with_password.port}".encode() in argv:
                    assert REDIS_PASSWORD.encode() not in argv


# ---- splitserve up passes it all through -----------------------------------------------------


def test_redis_over_tls_refuses_plaintext_and_strangers_and_serves_our_clients(pki) -> None:
    """A redis-server with TLS on its only port and client certificates asked (mutual TLS):
    a plaintext client and one whose certificate another CA signed get nothing; the
    registry's client and the gateway's rate limiter work through its rediss:// URL."""
    from splitserve.gateway.auth.limits import RateLimiter

    server_files: TlsFiles = pki["server"]
    with RedisServer(tls=server_files) as server:
        assert server.url.startswith("rediss://")
        plaintext = redis.Redis(host=server.host, port=server.port, socket_timeout=2)
        with pytest.raises(redis.ConnectionError):
            plaintext.ping()
        stranger: TlsFiles = pki["stranger"]
        as_stranger = redis.Redis(
            host=server.host,
            port=server.port,
            ssl=True,
            ssl_ca_certs=server_files.ca,
            ssl_certfile=stranger.cert,
            ssl_keyfile=stranger.key,
            socket_timeout=2,
        )
        with pytest.raises(redis.ConnectionError):
            as_stranger.ping()

        async def use() -> tuple[bool, float]:
            async with connect(server.url, timeout_s=2.0) as client:
                pinged = bool(await client.ping())
            limiter = RateLimiter(server.url)
            try:
                use = await limiter.add("tls-test", "requests", 1, 5)
            finally:
                await limiter.close()
            return pinged, use.used

        assert asyncio.run(use()) == (True, 1.0)
        counted = redis.Redis.from_url(server.url).keys("splitserve:limits:{tls-test}:*")
        assert counted, "the limiter counted in the TLS Redis, not in its own process"


def _up_args(pki, tmp_path: Path, *extra: str):
    from splitserve.cli import build_parser

    secret, password = tmp_path / "kv-secret", tmp_path / "redis-password"
    secret.write_bytes(SECRET)
    password.write_text(REDIS_PASSWORD)
    server: TlsFiles = pki["server"]
    argv = ["up", "--transport", "tcp", "--tls-cert", server.cert, "--tls-key", server.key]
    argv += ["--tls-ca", str(server.ca), "--tls-server-name", "splitserve-pod"]
    argv += ["--kv-secret-file", str(secret), "--redis-password-file", str(password), *extra]
    return build_parser().parse_args(argv)


def _value(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


def test_up_passes_tls_kv_secret_and_redis_password_files_to_the_processes(pki, tmp_path):
    from splitserve.launcher import plan

    args = _up_args(pki, tmp_path)
    the_plan = plan(args, prefill_available=True, redis_url="redis://127.0.0.1:1/0")
    by_name = {spec.name: spec for spec in the_plan.specs}
    assert set(by_name) == {"prefill-0", "decode-0", "gateway"}
    for spec in the_plan.specs:
        assert _value(spec.argv, "--tls-cert") == args.tls_cert
        assert _value(spec.argv, "--tls-ca") == args.tls_ca
        assert _value(spec.argv, "--tls-server-name") == "splitserve-pod"
        assert _value(spec.argv, "--redis-password-file") == args.redis_password_file
        assert REDIS_PASSWORD not in " ".join(spec.argv)  # paths, never the secrets
        assert SECRET.decode() not in " ".join(spec.argv)
    for name in ("prefill-0", "decode-0"):
        assert _value(by_name[name].argv, "--kv-secret-file") == args.kv_secret_file
        assert by_name[name].health.tls is not None  # up's own health checks speak TLS
    assert "--kv-secret-file" not in by_name["gateway"].argv
    assert by_name["gateway"].health.tls is None  # the gateway's public port stays as it was


@pytest.mark.slow
def test_up_stack_serves_over_tls_with_kv_secret_and_redis_auth(pki, tmp_path):
    """1 prefill + 1 decode pod and the gateway, as `splitserve up` starts them with every
    protection on, and a Redis with requirepass over mutual TLS (as up starts its own with
    --tls-cert): a prompt is prefilled remotely and answered."""
    import json
    import urllib.request

    from splitserve.launcher import plan

    with RedisServer(password=REDIS_PASSWORD, tls=pki["server"]) as redis_server:
        ports = [str(free_port()) for _ in range(4)]
        args = _up_args(
            pki,
            tmp_path,
            *("--port", ports[0], "--grpc-port", ports[1]),
            *("--prefill-port", ports[2], "--decode-port", ports[3]),
            *("--num-threads", "1", "--kv-cache-bytes", "64MiB"),
            *("--max-remote-prefill-tokens", "0", "--local-prefill-threshold", "0"),
        )
        the_plan = plan(args, prefill_available=True, redis_url=redis_server.url)
        with Supervisor() as supervisor:
            for spec in the_plan.specs:
                supervisor.start(spec)
            supervisor.wait_healthy(240.0)
            body = {"model": MODEL_NAME, "prompt": "The capital of France is", "max_tokens": 4}
            request = urllib.request.Request(
                f"{the_plan.http_url}/v1/completions",
                data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(request, timeout=120) as response:
                answer = json.load(response)
            assert answer["usage"]["completion_tokens"] == 4
            # The pods registered in the password-protected Redis.
            client = redis.Redis.from_url(redis_server.url, password=REDIS_PASSWORD)
            assert client.dbsize() > 0
