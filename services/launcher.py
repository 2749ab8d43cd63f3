"""`splitserve up`: the whole system on one machine (gateway, prefill and decode processes).

Which processes, on which ports, with which flags, is decided here (`plan`); starting,
health-checking and stopping them is splitserve.common.supervisor's job.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import shutil
import signal
import sys
import time
import urllib.request
from dataclasses import dataclass

from splitserve.common.cli_args import parse_size
from splitserve.common.redis_auth import redis_password, use_redis_password_file
from splitserve.common.redis_server import RedisServer
from splitserve.common.supervisor import (
    HealthCheck,
    ProcessGroupError,
    ProcessSpec,
    RestartPolicy,
    Supervisor,
)
from splitserve.common.tls import add_tls_flags, tls_argv, tls_from_args
from splitserve.engine.config import QUANTIZATION_METHODS
from splitserve.engine.kv.offload.sizing import auto_host_tier_bytes
from splitserve.gateway.admission.flags import (
    add_admission_flags,
    admission_argv,
    admission_settings,
)
from splitserve.pod.flags import (
    add_kv_cache_dtype_flag,
    add_quantization_flag,
    parse_tier_size,
)

DECODE_SERVICE = "splitserve.v1.DecodeWorker"
PREFILL_SERVICE = "splitserve.v1.PrefillWorker"
GENERATION_SERVICE = "splitserve.v1.Generation"


# Prefill processes' niceness beside decode processes on the same cores. 0 (equal priority):
# on 2 cores, 1 prefill + 1 decode pod, niceness 10 measured ITL medians of 20.6 / 21.0 /
# 25.4 / 32.9 / 51.5 ms at 1 / 2 / 4 / 8 / 16 streams against 19.6 / 21.7 / 26.6 / 33.7 /
# 47.5 ms at 0, back to back (python -m benchmarks.vs_vllm --parts streams --systems
# disaggregated [--up-flags '--prefill-nice 0']): no gain beyond noise, so no change by default.
PREFILL_NICE = 0
# Conditional disaggregation for the decode processes `up` starts: off (0, always send). On
# one machine the pods share its cores, so a decode process prefilling a prompt itself adds no
# compute while the prefill process works, and stalls every stream it runs. It was 256 while
# decode steps took both cores beside a computing prefill process (ITL median at 16 streams of
# 128-token prompts 0.71x vLLM's with 256 against 0.92x without, issue 15); since decode pods
# leave a computing prefill pod its threads (--neighbor-prefill-threads), on 2 cores, forced
# AVX2, 256 in / 64 out, our client: 16 streams ITL p50 118 against 81 ms with 256 (vLLM ~138),
# p99 235 against 1,203 (vLLM ~740), TTFT p50 2.2 against 3.7 s, same tokens/s; 4 streams p99 85
# against 86 (docs/benchmarks.md, issue 33). The pods' own default is 0 too (the chart's too).
UP_MAX_REMOTE_PREFILL_TOKENS = 0
# Prompt tokens in a step of only less important prompts, in every pod `up` starts
# (shared/step_importance.py). A step of 512 prompt tokens takes ~1.8 s on one AVX2 core here,
# 128 ~0.47 s, and a prompt's cost per token is within 4% at either (3.67 against 3.53 ms,
# SmolLM2-135M int4, 2026-12-03): short steps cost little, and a tenant within its share
# beside a flood waits for one of them, not for one of 512.
UP_MAX_BACKGROUND_PREFILL_TOKENS = 128
# As a kubelet would: back at once after a one-off crash, slower and slower in a crash loop.
RESTART_POLICY = RestartPolicy(initial_backoff_s=1.0, max_backoff_s=30.0, reset_after_s=60.0)


def add_up_flags(sub: argparse.ArgumentParser) -> None:
    sub.add_argument("--decode", type=int, default=1, metavar="N", help="decode processes")
    sub.add_argument("--prefill", type=int, default=1, metavar="N", help="prefill processes")
    sub.add_argument(
        "--colocated",
        action="store_true",
        help="no prefill processes: the decode processes prefill locally (the baseline)",
    )
    sub.add_argument(
        "--transport",
        default=None,
        choices=["ucx", "tcp"],
        help="KV transport between prefill and decode (default: ucx if ucxx imports, else tcp)",
    )
    sub.add_argument(
        "--local-prefill-threshold",
        type=int,
        default=32,
        metavar="TOKENS",
        help="decode pods prefill prompts with fewer uncached tokens than this themselves",
    )
    sub.add_argument(
        "--max-remote-prefill-tokens",
        type=int,
        default=UP_MAX_REMOTE_PREFILL_TOKENS,
        metavar="TOKENS",
        help="decode processes prefill prompts themselves while this many of their uncached "
        "prompt tokens (per stream a decode process runs, plus one) are in flight at the prefill "
        "process (conditional disaggregation; default 0 = always send: the processes share this "
        "machine's cores, so prefilling in a decode process adds no compute and stalls streams)",
    )
    sub.add_argument(
        "--max-prefill-tokens-while-decoding",
        type=int,
        default=None,
        metavar="TOKENS",
        help="decode (and colocated) processes: prompt tokens in a step that also decodes, so "
        "prompts arriving cannot stall the running streams (default: no cap)",
    )
    sub.add_argument(
        "--max-background-prefill-tokens",
        type=int,
        default=UP_MAX_BACKGROUND_PREFILL_TOKENS,
        metavar="TOKENS",
        help="every process: prompt tokens in a step that holds only prompts less important "
        "than one sent lately (admission control sends a tenant within its share ahead of one "
        f"over it); default {UP_MAX_BACKGROUND_PREFILL_TOKENS}, 0 = every prompt alike",
    )
    sub.add_argument(
        "--max-waiting-requests",
        type=int,
        default=0,
        metavar="N",
        help="decode (and colocated) processes refuse a request that could not start at once "
        "while N already wait there; the gateway routes it to another (0 = no bound)",
    )
    sub.add_argument(
        "--kv-checksum", action="store_true", help="prefill pods CRC-32 every KV page buffer"
    )
    sub.add_argument("--host", default="127.0.0.1", help="address every process binds")
    sub.add_argument("--port", type=int, default=8000, help="the gateway's HTTP port")
    sub.add_argument("--grpc-port", type=int, default=50051, help="the gateway's gRPC port")
    sub.add_argument("--decode-port", type=int, default=50061, help="first decode gRPC port")
    sub.add_argument("--prefill-port", type=int, default=50071, help="first prefill gRPC port")
    sub.add_argument(
        "--model", default=None, help="a .gguf file or HF directory (default: SmolLM2)"
    )
    sub.add_argument("--model-name", default=None, help="served model name")
    add_quantization_flag(sub)
    sub.add_argument(
        "--prefill-quantization",
        default=None,
        choices=QUANTIZATION_METHODS,
        help="the prefill processes' weights, where they should differ (default: --quantization)",
    )
    # One value for every engine process: pages travel between pods as they are stored.
    add_kv_cache_dtype_flag(sub)
    sub.add_argument(
        "--kv-cache-bytes", default="256MiB", help="KV cache of each engine process, e.g. 256MiB"
    )
    sub.add_argument(
        "--kv-offload-host-bytes",
        type=parse_tier_size,
        default="auto",
        metavar="SIZE|auto|0",
        help="host-memory KV tier of each engine process (auto: half of the free memory after "
        "the KV caches, shared between the processes; 0: off)",
    )
    sub.add_argument(
        "--kv-offload-disk-dir",
        default=None,
        help="disk KV tier: each engine process keeps its block files in DIR/<its name>, and "
        "finds them again when it is restarted (default: no disk tier)",
    )
    sub.add_argument(
        "--kv-offload-disk-bytes",
        type=parse_tier_size,
        default="1GiB",
        metavar="SIZE",
        help="size cap of each engine process's disk tier (with --kv-offload-disk-dir)",
    )
    sub.add_argument(
        "--num-threads",
        type=int,
        default=None,
        help="torch threads per engine process (default: decode processes every core, each "
        "picking 1 or all per step by measurement; prefill processes a share of the cores)",
    )
    sub.add_argument(
        "--prefill-nice",
        type=int,
        default=PREFILL_NICE,
        metavar="N",
        help=f"niceness of prefill processes (default {PREFILL_NICE}: the decode processes' "
        "priority); higher lets a decode step, which every stream waits for, go first on "
        "shared cores",
    )
    sub.add_argument(
        "--redis-url",
        default=os.environ.get("REDIS_URL") or None,
        help="the Redis for the registry and prefix index (default: $REDIS_URL, else a "
        "redis-server started here on a free port)",
    )
    sub.add_argument(
        "--no-redis", action="store_true", help="no registry: route by load only (static pods)"
    )
    sub.add_argument(
        "--routing-policy",
        default="cache_aware",
        choices=["cache_aware", "least_load", "round_robin"],
    )
    sub.add_argument(
        "--strip-system-line-prefix",
        action="append",
        default=[],
        metavar="PREFIX",
        help="the gateway's /v1/messages drops a system prompt's first line starting with "
        "PREFIX (repeatable; e.g. 'x-anthropic-billing-header:', for prefix caching)",
    )
    sub.add_argument(
        "--api-keys",
        default=None,
        metavar="FILE",
        help="the gateway's API keys, tenants and limits (JSON or YAML; docs/security.md); "
        "none = open to anyone",
    )
    sub.add_argument(
        "--metrics-public", action="store_true", help="the gateway's /metrics without a key"
    )
    sub.add_argument(
        "--server-timing",
        action="store_true",
        help="the gateway's generation responses carry a Server-Timing header (docs/api.md)",
    )
    sub.add_argument(
        "--lora-modules",
        nargs="+",
        default=[],
        metavar="NAME=PATH",
        help='PEFT adapters every engine pod serves by name (clients put it in "model")',
    )
    sub.add_argument(
        "--enable-lora", action="store_true", help="pods take adapters loaded at run time"
    )
    sub.add_argument("--max-loras", type=int, default=None, help="active adapter slots per pod")
    add_security_flags(sub)
    add_admission_flags(sub)  # the gateway's, passed through as given
    sub.add_argument("--startup-timeout", type=float, default=300.0, help="seconds")
    sub.add_argument(
        "--exit-on-failure",
        action="store_true",
        help="stop everything when any process exits (default: restart it with back-off, as "
        "Kubernetes restarts a pod, while the others keep serving)",
    )
    sub.add_argument(
        "--log-level",
        default="warning",
        choices=["debug", "info", "warning", "error"],
        help="log level of the started processes",
    )


def add_security_flags(sub: argparse.ArgumentParser) -> None:
    """Passed through to the processes as given (docs/security.md)."""
    add_tls_flags(sub)  # pods serve gRPC over TLS; the gateway and pods dial them with it
    sub.add_argument(
        "--kv-secret-file",
        default=None,
        metavar="PATH",
        help="tcp KV transport: prefill and decode prove this secret on connect",
    )
    sub.add_argument(
        "--redis-password-file",
        default=None,
        metavar="PATH",
        help="Redis AUTH password for every process (a redis-server started here requires it)",
    )


def _security_flags(args: argparse.Namespace) -> list[str]:
    """The --tls-* and --redis-password-file flags every process gets."""
    flags = tls_argv(tls_from_args(args))
    if args.redis_password_file:
        flags += ["--redis-password-file", args.redis_password_file]
    return flags


@dataclass(frozen=True)
class Plan:
    specs: list[ProcessSpec]  # start order: engine pods, then the gateway
    mode_note: str  # one line on how prefill happens
    http_url: str
    grpc_address: str


def plan(
    args: argparse.Namespace, prefill_available: bool | None = None, redis_url: str | None = None
) -> Plan:
    """The processes to start. `prefill_available` says whether services/prefill exists
    (default: look for it); `redis_url` is passed to every process (None: no registry)."""
    if args.decode < 1 or args.prefill < 0:
        raise ValueError("--decode must be >= 1 and --prefill >= 0")
    admission_settings(args)  # the gateway's checks, before anything starts
    if args.local_prefill_threshold < 0:
        raise ValueError("--local-prefill-threshold must be >= 0")
    if args.max_remote_prefill_tokens < 0:
        raise ValueError("--max-remote-prefill-tokens must be >= 0")
    if args.max_waiting_requests < 0:
        raise ValueError("--max-waiting-requests must be >= 0")
    cap = args.max_prefill_tokens_while_decoding
    if cap is not None and cap < 1:
        raise ValueError(f"--max-prefill-tokens-while-decoding must be >= 1, got {cap}")
    if args.max_background_prefill_tokens < 0:
        raise ValueError("--max-background-prefill-tokens must be >= 0")
    if not 0 <= args.prefill_nice <= 19:
        raise ValueError(f"--prefill-nice must be within 0..19, got {args.prefill_nice}")
    if prefill_available is None:
        prefill_available = importlib.util.find_spec("splitserve.prefill") is not None
    colocated, note = _mode(args, prefill_available)
    num_prefill = 0 if colocated else args.prefill
    transport, transport_note = _transport(args, colocated)
    threads = _thread_split(args, num_prefill, args.decode)
    engine_flags = _engine_flags(args, transport)
    # Every process: where Redis is, and the TLS files and Redis password they all use.
    shared_flags = (["--redis-url", redis_url] if redis_url else []) + _security_flags(args)
    engine_flags += shared_flags
    if args.kv_secret_file:
        engine_flags += ["--kv-secret-file", args.kv_secret_file]
    prefill_addresses = [f"{args.host}:{args.prefill_port + i}" for i in range(num_prefill)]
    decode_addresses = [f"{args.host}:{args.decode_port + i}" for i in range(args.decode)]
    prefill_flags = ["--num-threads", str(threads.prefill), "--nice", str(args.prefill_nice)]
    prefill_flags += ["--kv-checksum"] if args.kv_checksum else []
    prefill_flags += _prefill_quantization(args)
    decode_flags = ["--num-threads", str(threads.decode)]
    if args.max_prefill_tokens_while_decoding is not None:
        cap = args.max_prefill_tokens_while_decoding
        decode_flags += ["--max-prefill-tokens-while-decoding", str(cap)]
    if args.max_waiting_requests:
        decode_flags += ["--max-waiting-requests", str(args.max_waiting_requests)]
    decode_flags += [] if colocated else _decode_flags(args)
    if not colocated and not args.num_threads:
        # Every pod of `up` shares this machine's cores: a decode pod leaves a prefill pod
        # its threads while it computes (the decode pod's thread count is tuned, not fixed).
        decode_flags += ["--neighbor-prefill-threads", str(threads.prefill)]
    engine_flags += _host_tier_flags(args, num_prefill + args.decode)
    specs = [
        _pod("prefill", i, address, PREFILL_SERVICE, engine_flags + prefill_flags, args)
        for i, address in enumerate(prefill_addresses)
    ] + [
        _pod("decode", i, address, DECODE_SERVICE, engine_flags + decode_flags, args)
        for i, address in enumerate(decode_addresses)
    ]
    specs.append(_gateway(args, decode_addresses, prefill_addresses, shared_flags))
    note += f"{transport_note}; torch threads: {threads.decode} per decode process"
    note += "" if colocated else f", {threads.prefill} per prefill process"
    note += f"; routing {args.routing_policy}" + (f" (Redis {redis_url})" if redis_url else "")
    return Plan(specs, note, f"http://{args.host}:{args.port}", f"{args.host}:{args.grpc_port}")


def _mode(args: argparse.Namespace, prefill_available: bool) -> tuple[bool, str]:
    if args.colocated:
        return True, "colocated: each decode process prefills its own prompts"
    if args.prefill == 0:
        return True, "colocated (--prefill 0): each decode process prefills its own prompts"
    if not prefill_available:
        return True, (
            "colocated: services/prefill does not exist yet, so no prefill process was "
            "started and each decode process prefills its own prompts"
        )
    return False, f"disaggregated: {args.prefill} prefill process(es)"


def _transport(args: argparse.Namespace, colocated: bool) -> tuple[str, str]:
    """The KV transport, and how it was chosen (for the mode line)."""
    if args.transport is not None:
        return args.transport, "" if colocated else f", KV over {args.transport}"
    if colocated:
        # No pages travel; decode pods still listen, and a TCP listener costs nothing where
        # UCX would start a progress thread.
        return "tcp", ""
    if importlib.util.find_spec("ucxx") is not None:
        return "ucx", ", KV over ucx (ucxx found; --transport tcp for plain TCP)"
    return "tcp", ", KV over tcp (ucxx is not installed)"


@dataclass(frozen=True)
class ThreadSplit:
    """Torch threads per engine process, by role."""

    prefill: int
    decode: int


def _thread_split(args: argparse.Namespace, num_prefill: int, num_decode: int) -> ThreadSplit:
    """--num-threads for every engine process when given. Otherwise decode pods may use every
    core and pick 1 or all per step by measurement (shared/thread_tuner.py), since their steps
    are what a stream waits for and the other processes (a prefill pod between bursts, the
    gateway, Redis) leave cores idle most of the time; prefill pods take a fixed share of the
    cores, so that their compute-bound bursts do not also crowd the decode pods' threads.

    Measured on 2 cores, 1 prefill + 1 decode pod, ITL medians at 1 / 2 / 4 / 8 / 16 streams
    (python -m benchmarks.vs_vllm --parts streams --systems disaggregated): 16.5 / 17.7 / 23.4 /
    29.0 / 45.4 ms with this split, 18.3 / 19.7 / 23.1 / 34.0 / 47.6 ms with every pod on every
    core, and with one thread per pod 20.5 / - / 24.4 / - / 42.6 (--quick)."""
    if args.num_threads:
        return ThreadSplit(args.num_threads, args.num_threads)
    cores = os.cpu_count() or 1
    return ThreadSplit(prefill=max(1, cores // (num_prefill + num_decode)), decode=cores)


def _host_tier_flags(args: argparse.Namespace, num_engines: int) -> list[str]:
    """Each engine process's host tier. "auto" is sized here, once for all of them: a tier's
    slab takes memory only as blocks are written into it, so processes sizing themselves
    would each count the same free memory."""
    size = args.kv_offload_host_bytes
    if size == "auto":
        pools = num_engines * parse_size(str(args.kv_cache_bytes))
        size = auto_host_tier_bytes(pools) // num_engines
    return ["--kv-offload-host-bytes", str(size)]


def _disk_tier_flags(args: argparse.Namespace, name: str) -> list[str]:
    if not args.kv_offload_disk_dir:
        return []
    directory = os.path.join(args.kv_offload_disk_dir, name)
    size = str(args.kv_offload_disk_bytes)
    return ["--kv-offload-disk-dir", directory, "--kv-offload-disk-bytes", size]


def _decode_flags(args: argparse.Namespace) -> list[str]:
    return [
        "--local-prefill-threshold",
        str(args.local_prefill_threshold),
        "--max-remote-prefill-tokens",
        str(args.max_remote_prefill_tokens),
        "--quantization",
        args.quantization,
    ]


def _prefill_quantization(args: argparse.Namespace) -> list[str]:
    return ["--quantization", args.prefill_quantization or args.quantization]


def _engine_flags(args: argparse.Namespace, transport: str) -> list[str]:
    flags = ["--kv-cache-bytes", str(args.kv_cache_bytes)]
    flags += ["--kv-cache-dtype", args.kv_cache_dtype]
    flags += ["--kv-transport", transport, "--log-level", args.log_level]
    if args.model is not None:
        flags += ["--model", args.model]
    if args.model_name is not None:
        flags += ["--model-name", args.model_name]
    if args.lora_modules:  # each pod resolves the paths itself: made absolute here
        flags += ["--lora-modules", *map(_absolute_lora_module, args.lora_modules)]
    if args.enable_lora:
        flags += ["--enable-lora"]
    if args.max_loras is not None:
        flags += ["--max-loras", str(args.max_loras)]
    if args.max_background_prefill_tokens:
        flags += ["--max-background-prefill-tokens", str(args.max_background_prefill_tokens)]
    return flags


def _absolute_lora_module(module: str) -> str:
    name, sep, path = module.partition("=")
    return f"{name}={os.path.abspath(path)}" if sep and path else module


def _pod(
    role: str,
    index: int,
    address: str,
    service: str,
    engine_flags: list[str],
    args: argparse.Namespace,
) -> ProcessSpec:
    port = address.rsplit(":", 1)[1]
    name = f"{role}-{index}"
    argv = [sys.executable, "-m", f"splitserve.{role}", "--host", args.host, "--port", port]
    argv += ["--worker-id", name, *engine_flags, *_disk_tier_flags(args, name)]
    health = HealthCheck(grpc_address=address, grpc_service=service, tls=tls_from_args(args))
    return ProcessSpec(name, argv, health)


def _gateway(
    args: argparse.Namespace,
    decode_addresses: list[str],
    prefill_addresses: list[str],
    shared_flags: list[str],
) -> ProcessSpec:
    argv = [sys.executable, "-m", "splitserve.gateway", "--host", args.host]
    argv += ["--port", str(args.port), "--grpc-port", str(args.grpc_port)]
    argv += ["--routing-policy", args.routing_policy, *shared_flags]
    argv += ["--log-level", args.log_level]
    for prefix in args.strip_system_line_prefix:
        argv += ["--strip-system-line-prefix", prefix]
    if args.api_keys:
        argv += ["--api-keys", os.path.abspath(args.api_keys)]
    if args.metrics_public:
        argv += ["--metrics-public"]
    if args.server_timing:
        argv += ["--server-timing"]
    argv += admission_argv(args)
    for address in decode_addresses:
        argv += ["--decode", address]
    for address in prefill_addresses:
        argv += ["--prefill", address]
    if args.model is not None:
        argv += ["--model", args.model]
    if args.model_name is not None:
        argv += ["--model-name", args.model_name]
    health = HealthCheck(
        grpc_address=f"{args.host}:{args.grpc_port}",
        grpc_service=GENERATION_SERVICE,
        http_url=f"http://{args.host}:{args.port}/health",
    )
    return ProcessSpec("gateway", argv, health)


def run_up(args: argparse.Namespace) -> int:
    """Starts everything, waits for health, then supervises until Ctrl-C / SIGTERM."""
    with contextlib.ExitStack() as stack:
        redis_url = _redis_url(args, stack)
        return _run_plan(args, plan(args, redis_url=redis_url))


def _redis_url(args: argparse.Namespace, stack: contextlib.ExitStack) -> str | None:
    """--redis-url, else a redis-server child (stopped when `stack` closes), else None."""
    if args.no_redis:
        return None
    if args.redis_url:
        return args.redis_url
    if shutil.which("redis-server") is None:
        print("[up] redis-server is not installed: routing by load only", file=sys.stderr)
        return None
    password = None
    if args.redis_password_file:
        use_redis_password_file(args.redis_password_file)  # checks the file, as a pod would
        password = redis_password()
    # With --tls-cert, Redis speaks TLS too (mutual with --tls-ca): the pods' index and the
    # gateway's limits travel encrypted, under the same certificate as gRPC.
    tls = tls_from_args(args)
    server = stack.enter_context(RedisServer(host=args.host, password=password, tls=tls))
    print(f"[up] started redis-server on {server.url}", flush=True)
    return server.url


def _run_plan(args: argparse.Namespace, the_plan: Plan) -> int:
    stop_requested = _StopFlag()
    with Supervisor() as supervisor:
        print(f"[up] {the_plan.mode_note}", flush=True)
        for spec in the_plan.specs:
            supervisor.start(spec)
        print(f"[up] started {', '.join(supervisor.names)}; waiting until healthy", flush=True)
        try:
            supervisor.wait_healthy(args.startup_timeout, _Progress(stop_requested))
            print(_banner(the_plan, args), flush=True)
            while not stop_requested.is_set:
                _supervise(supervisor, args.exit_on_failure)
                time.sleep(0.5)
        except _Stop:
            pass
        except ProcessGroupError as error:
            print(f"[up] {error}; stopping everything", file=sys.stderr, flush=True)
            return 1
        finally:
            stop_requested.restore()
            print("[up] stopping", flush=True)
    print("[up] stopped", flush=True)
    return 0


def _supervise(supervisor: Supervisor, exit_on_failure: bool) -> None:
    """One round of watching the running stack: a process that exited is restarted (and
    said so), or, with --exit-on-failure, ends it all (ProcessGroupError)."""
    if exit_on_failure:
        supervisor.check_alive()
        return
    for event in supervisor.restart_exited(RESTART_POLICY):
        print(f"[up] {event}", flush=True)


class _Stop(Exception):
    pass


class _StopFlag:
    """Ctrl-C and SIGTERM set the flag instead of killing the supervisor mid-way."""

    def __init__(self) -> None:
        self.is_set = False
        self._previous = {
            sig: signal.signal(sig, self._set) for sig in (signal.SIGINT, signal.SIGTERM)
        }

    def _set(self, signum, frame) -> None:
        self.is_set = True

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


class _Progress:
    """Prints which processes are healthy whenever that changes, and every 5 s otherwise."""

    def __init__(self, stop: _StopFlag) -> None:
        self._stop = stop
        self._last: tuple[dict[str, bool], float] | None = None

    def __call__(self, elapsed: float, status: dict[str, bool]) -> None:
        if self._stop.is_set:
            raise _Stop()
        if self._last is not None and self._last[0] == status and elapsed - self._last[1] < 5:
            return
        self._last = (dict(status), elapsed)
        parts = [f"{name} {'ready' if ok else 'starting'}" for name, ok in status.items()]
        print(f"[up] {elapsed:5.1f}s  {'  '.join(parts)}", flush=True)


def _banner(the_plan: Plan, args: argparse.Namespace) -> str:
    model = _served_model(the_plan.http_url) or args.model_name or "default"
    body = json.dumps(
        {
            "model": model,
            "messages": [{"role": "user", "content": "Why is the sky blue?"}],
            "max_tokens": 64,
        }
    )
    url = f"{the_plan.http_url}/v1/chat/completions"
    return "\n".join(
        [
            "",
            "splitserve is up",
            f"  OpenAI API   {the_plan.http_url}/v1   (model: {model})",
            f"  gRPC         {the_plan.grpc_address}   ({GENERATION_SERVICE})",
            f"  metrics      {the_plan.http_url}/metrics",
            f"  mode         {the_plan.mode_note}",
            "",
            "Try:",
            f"  curl {url} -H 'Content-Type: application/json' \\",
            f"    -d '{body}'",
            "",
            "Ctrl-C stops everything.",
        ]
    )


def _served_model(http_url: str) -> str | None:
    try:
        with urllib.request.urlopen(f"{http_url}/v1/models", timeout=2.0) as response:
            return json.load(response)["data"][0]["id"]
    except (OSError, ValueError, KeyError, IndexError):
        return None
