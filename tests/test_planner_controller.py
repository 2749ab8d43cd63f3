"""The autoscaler: its decisions over sequences of readings, the requests it sends to the
Kubernetes API (a local HTTP server that answers like the API server and records them; no
cluster runs here), and the load sources against real /metrics text and a real Redis."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from splitserve.planner.__main__ import build_parser
from splitserve.planner.autoscale.controller import Autoscaler, Bounds, PolicySettings
from splitserve.planner.autoscale.load import (
    LoadSnapshot,
    MetricsLoadSource,
    RedisLoadSource,
    RoleLoad,
    histogram_quantile,
)
from splitserve.planner.autoscale.loop import Controller, Deployments, DeploymentScaler
from splitserve.planner.profile import synthetic_profile

NAMESPACE = "serving"
DEPLOYMENTS = Deployments("splitserve-prefill", "splitserve-decode")
INTERVAL_S = 15.0


# ---- a Kubernetes API server stand-in -------------------------------------------------------


@dataclass(frozen=True)
class Recorded:
    method: str
    path: str
    content_type: str
    body: dict | None


class FakeApiServer:
    """Serves GET and PATCH of `deployments/{name}/scale` for the Deployments it is given,
    as the API server does (a Scale object back), and records every request."""

    def __init__(self, replicas: dict[str, int]) -> None:
        self.replicas = dict(replicas)
        self.requests: list[Recorded] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                server._handle(self, None)

            def do_PATCH(self) -> None:
                length = int(self.headers.get("Content-Length", 0))
                server._handle(self, json.loads(self.rfile.read(length)))

            def log_message(self, *args: object) -> None:
                pass

        self._http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._http.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._http.server_address[1]}"

    def __enter__(self) -> FakeApiServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._http.shutdown()
        self._http.server_close()

    def patches(self) -> list[Recorded]:
        return [r for r in self.requests if r.method == "PATCH"]

    def _handle(self, handler: BaseHTTPRequestHandler, body: dict | None) -> None:
        content_type = handler.headers.get("Content-Type", "")
        self.requests.append(Recorded(handler.command, handler.path, content_type, body))
        prefix = f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/"
        name = handler.path.removeprefix(prefix).removesuffix("/scale")
        if not handler.path.startswith(prefix) or name not in self.replicas:
            return self._reply(handler, 404, {"kind": "Status", "code": 404, "reason": "NotFound"})
        if body is not None:
            self.replicas[name] = body["spec"]["replicas"]
        scale = {
            "apiVersion": "autoscaling/v1",
            "kind": "Scale",
            "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": {"replicas": self.replicas[name]},
            "status": {"replicas": self.replicas[name]},
        }
        self._reply(handler, 200, scale)

    @staticmethod
    def _reply(handler: BaseHTTPRequestHandler, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        handler.send_response(status)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        handler.wfile.write(data)


class ScriptedLoad:
    """Our LoadSource protocol, replaying readings in order (the last one repeats)."""

    def __init__(self, readings: list[LoadSnapshot]) -> None:
        self.readings = readings
        self.count = 0

    def read(self) -> LoadSnapshot:
        reading = self.readings[min(self.count, len(self.readings) - 1)]
        self.count += 1
        return reading


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _settings(**overrides: object) -> PolicySettings:
    values: dict = dict(
        ttft_slo_s=1.0,
        itl_slo_s=0.1,
        prefill=Bounds(1, 4),
        decode=Bounds(1, 4),
        cooldown_s=120.0,
        breach_readings=3,
        idle_readings=6,
    )
    values.update(overrides)
    return PolicySettings(**values)


BUSY_DECODE = RoleLoad(num_pods=1, num_running=8, kv_blocks_used=120, kv_blocks_total=200)
BREACH = LoadSnapshot(
    prefill=RoleLoad(num_pods=1, num_running=4), decode=BUSY_DECODE, ttft_s=3.0, itl_s=0.06
)
NORMAL = LoadSnapshot(
    prefill=RoleLoad(num_pods=1, num_running=2), decode=BUSY_DECODE, ttft_s=0.8, itl_s=0.06
)
IDLE = LoadSnapshot(prefill=RoleLoad(num_pods=1), decode=RoleLoad(num_pods=1, kv_blocks_total=200))


def _run(api: FakeApiServer, readings, settings=None, profile=None, dry_run=False, ticks=None):
    clock = Clock()
    lines: list[str] = []
    controller = Controller(
        Autoscaler(settings or _settings(), profile),
        ScriptedLoad(readings),
        DeploymentScaler(NAMESPACE, api.url),
        DEPLOYMENTS,
        dry_run=dry_run,
        clock=clock,
        out=lines.append,
    )
    changes = []  # (time, role, new replicas)
    for _ in range(ticks or len(readings)):
        decisions = controller.tick()
        changes += [(clock.now, d.role, d.desired) for d in decisions if d.changes]
        clock.now += INTERVAL_S
    return changes, lines


def _patch_path(deployment: str) -> str:
    return f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/{deployment}/scale"


def test_scales_prefill_up_on_a_sustained_ttft_breach() -> None:
    with FakeApiServer({DEPLOYMENTS.prefill: 1, DEPLOYMENTS.decode: 1}) as api:
        _run(api, [BREACH, BREACH])
        assert api.patches() == []  # two breaches are not yet sustained
        _run(api, [BREACH] * 3)
        (patch,) = api.patches()
    assert patch.path == _patch_path(DEPLOYMENTS.prefill)
    assert patch.body == {"spec": {"replicas": 2}}
    assert "patch" in patch.content_type  # a PATCH body type, e.g. merge-patch+json
    assert api.replicas == {DEPLOYMENTS.prefill: 2, DEPLOYMENTS.decode: 1}


def test_scales_down_when_idle_after_the_cooldown_and_not_below_min() -> None:
    with FakeApiServer({DEPLOYMENTS.prefill: 3, DEPLOYMENTS.decode: 2}) as api:
        changes, _ = _run(api, [IDLE] * 40)
        patches = api.patches()
    # Idle for 6 readings (75 s after the first), then one pod per cooldown, down to min 1.
    assert [(p.path, p.body["spec"]["replicas"]) for p in patches] == [
        (_patch_path(DEPLOYMENTS.prefill), 2),
        (_patch_path(DEPLOYMENTS.decode), 1),
        (_patch_path(DEPLOYMENTS.prefill), 1),
    ]
    assert changes[0] == (1000.0 + 5 * INTERVAL_S, "prefill", 2)
    assert changes[2][0] - changes[0][0] >= 120.0  # the same role waits out its cooldown
    assert api.replicas == {DEPLOYMENTS.prefill: 1, DEPLOYMENTS.decode: 1}


def test_never_flaps_on_an_oscillating_load() -> None:
    # Two breaches, two normal readings, over and over: never three breaches in a row.
    oscillating = [BREACH, BREACH, NORMAL, NORMAL] * 15
    with FakeApiServer({DEPLOYMENTS.prefill: 2, DEPLOYMENTS.decode: 1}) as api:
        _run(api, oscillating)
        assert api.patches() == []
    # A real breach, then idle at once: up, and down only after the cooldown, once.
    with FakeApiServer({DEPLOYMENTS.prefill: 2, DEPLOYMENTS.decode: 2}) as api:
        changes, _ = _run(api, [BREACH] * 3 + [IDLE] * 30)
        patches = [p for p in api.patches() if p.path == _patch_path(DEPLOYMENTS.prefill)]
    assert [p.body["spec"]["replicas"] for p in patches][:2] == [3, 2]
    for role in ("prefill", "decode"):
        times = [time for time, changed_role, _ in changes if changed_role == role]
        assert all(later - earlier >= 120.0 for earlier, later in zip(times, times[1:]))


def test_breaches_never_scale_past_max() -> None:
    with FakeApiServer({DEPLOYMENTS.prefill: 1, DEPLOYMENTS.decode: 1}) as api:
        _run(api, [BREACH] * 60, settings=_settings(prefill=Bounds(1, 3), cooldown_s=0.0))
        replicas = [p.body["spec"]["replicas"] for p in api.patches()]
    assert replicas == [2, 3]


def test_the_model_scales_to_the_measured_rate_in_one_step() -> None:
    # 0.5 s per prefill step (two 256-token prompts share one under the 512-token budget): at
    # 4 req/s one pod saturates. The model (recommend's test, tests/test_planner_sizing.py)
    # asks for more than one breach would add, and the autoscaler goes there in one step.
    from splitserve.planner.sizing import pods_needed, steady_workload

    profile = synthetic_profile(0.5, decode_step_s=0.01)
    settings = _settings()
    needed = pods_needed(
        profile,
        steady_workload(4.0, 256, 32),
        settings.target,
        "prefill",
        {"prefill": 1, "decode": 1},
        settings.prefill.max_replicas,
    )
    assert needed is not None and needed >= 3
    loaded = LoadSnapshot(
        prefill=RoleLoad(num_pods=1, num_running=1),
        decode=BUSY_DECODE,
        ttft_s=0.5,
        itl_s=0.02,
        request_rate=4.0,
        prompt_tokens_per_s=4.0 * 256,
        output_tokens_per_s=4.0 * 32,
    )
    with FakeApiServer({DEPLOYMENTS.prefill: 1, DEPLOYMENTS.decode: 1}) as api:
        _run(api, [loaded] * 3, profile=profile)
        (patch,) = api.patches()
    assert patch.path == _patch_path(DEPLOYMENTS.prefill)
    assert patch.body == {"spec": {"replicas": needed}}


def test_dry_run_prints_decisions_and_patches_nothing() -> None:
    with FakeApiServer({DEPLOYMENTS.prefill: 1, DEPLOYMENTS.decode: 1}) as api:
        _, lines = _run(api, [BREACH] * 3, dry_run=True)
        assert api.patches() == []
        assert {r.method for r in api.requests} == {"GET"}
    assert "prefill: would scale 1 -> 2" in lines[-1]
    assert "TTFT p90 3000ms" in lines[-1]


def test_an_api_error_skips_the_reading_and_the_loop_goes_on() -> None:
    # The prefill Deployment does not exist: the API answers 404; nothing is patched.
    with FakeApiServer({DEPLOYMENTS.decode: 1}) as api:
        _, lines = _run(api, [BREACH] * 4)
        assert api.patches() == []
    assert len(lines) == 4
    assert all("Kubernetes API: HTTP 404" in line for line in lines)


def test_bad_bounds_and_slos_are_errors() -> None:
    with pytest.raises(ValueError, match="min <= max"):
        Bounds(3, 2)
    with pytest.raises(ValueError, match="--ttft-slo"):
        _settings(ttft_slo_s=0)


def test_parser_has_the_chart_flags() -> None:
    parser = build_parser()
    args = parser.parse_args(
        [
            "autoscale",
            "--namespace", "ns", "--prefill-deployment", "p", "--decode-deployment", "d",
            "--profile", "x.json", "--redis-url", "redis://r:6379/0",
            "--metrics-url", "http://m/metrics", "--ttft-slo", "2", "--itl-slo", "0.1",
            "--min-prefill", "1", "--max-prefill", "4", "--min-decode", "1", "--max-decode", "6",
            "--cooldown", "60", "--interval", "10", "--dry-run",
            "--max-remote-prefill-tokens", "4096", "--pods-per-host", "2",
        ]
    )  # fmt: skip
    assert (args.max_decode, args.cooldown, args.dry_run) == (6, 60.0, True)
    assert (args.max_remote_prefill_tokens, args.pods_per_host) == (4096, 2)
    subcommands = parser._subparsers._group_actions[0].choices  # noqa: SLF001
    assert set(subcommands) == {"profile", "simulate", "recommend", "validate", "autoscale"}


# ---- load sources ---------------------------------------------------------------------------


class MetricsServer:
    """Serves a prometheus_client registry with the pods' metric names at /metrics."""

    def __init__(self, role: str) -> None:
        self.registry = CollectorRegistry()
        labels = ("model_name", "role")
        buckets = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
        registry = self.registry
        name = "splitserve:"
        self.ttft = Histogram(
            name + "time_to_first_token_seconds", "", labels, buckets=buckets, registry=registry
        ).labels("m", role)
        self.itl = Histogram(
            name + "inter_token_latency_seconds", "", labels, buckets=buckets, registry=registry
        ).labels("m", role)
        success_labels = (*labels, "finished_reason")
        self.success = Counter(
            name + "request_success", "", success_labels, registry=registry
        ).labels("m", role, "length")
        self.prompt = Counter(name + "prompt_tokens", "", labels, registry=registry).labels(
            "m", role
        )
        self.waiting = Gauge(name + "num_requests_waiting", "", labels, registry=registry).labels(
            "m", role
        )

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                data = generate_latest(registry)
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass

        self._http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._http.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self._http.server_address[1]}/metrics"

    def close(self) -> None:
        self._http.shutdown()
        self._http.server_close()


def test_metrics_source_reads_recent_latencies_and_rates() -> None:
    decode, prefill = MetricsServer("decode"), MetricsServer("prefill")
    clock = Clock()
    try:
        source = MetricsLoadSource(lambda: [decode.url, prefill.url], clock=clock)
        for _ in range(50):
            decode.ttft.observe(0.05)  # old history: must not count in the next reading
        first = source.read()
        assert first.request_rate is None  # no previous scrape to take a rate from
        for seconds in [0.3] * 80 + [2.0] * 20:
            decode.ttft.observe(seconds)
        decode.itl.observe(0.07)
        decode.success.inc(30)
        decode.prompt.inc(30 * 200)
        decode.waiting.set(3)
        prefill.waiting.set(5)
        clock.now += 10.0
        second = source.read()
    finally:
        decode.close()
        prefill.close()
    # p90 of the 100 new TTFTs lies in the (1.0, 2.5] bucket; the 50 old 0.05 s ones are gone.
    assert 1.0 < second.ttft_s <= 2.5
    assert 0.05 < second.itl_s <= 0.1
    assert second.request_rate == pytest.approx(3.0)
    assert second.prompt_tokens_per_s == pytest.approx(600.0)
    assert (second.decode.num_waiting, second.prefill.num_waiting) == (3, 5)
    assert (second.decode.num_pods, second.prefill.num_pods) == (1, 1)


def test_histogram_quantile_interpolates_in_its_bucket() -> None:
    buckets = {0.1: 10.0, 0.5: 60.0, 1.0: 100.0, float("inf"): 100.0}
    assert histogram_quantile(buckets, 0.5) == pytest.approx(0.1 + 0.4 * 40 / 50)
    assert histogram_quantile({0.1: 0.0, float("inf"): 0.0}, 0.9) is None


def test_redis_source_sums_the_registry_records() -> None:
    import redis

    from splitserve.common.pod_load import PodLoad
    from splitserve.common.redis_server import RedisServer
    from splitserve.common.registry_schema import HEARTBEAT_SCRIPT, PodRecord, RegistryKeys

    keys = RegistryKeys()
    with RedisServer() as server:
        client = redis.Redis.from_url(server.url)
        pods = [
            PodRecord("prefill-0", "prefill", "10.0.0.1:50071", 1, load=PodLoad(
                      kv_blocks_total=100, kv_blocks_free=40, num_running=2, num_waiting=3)),
            PodRecord("decode-0", "decode", "10.0.0.2:50061", 1, load=PodLoad(
                      kv_blocks_total=200, kv_blocks_free=50, num_running=7, num_waiting=1)),
            PodRecord("decode-1", "decode", "10.0.0.3:50061", 1, load=PodLoad(
                      kv_blocks_total=200, kv_blocks_free=150, num_running=3, num_waiting=0)),
        ]  # fmt: skip
        for pod in pods:
            fields = [item for pair in pod.to_fields().items() for item in pair]
            client.eval(
                HEARTBEAT_SCRIPT, 4, keys.generation(pod.pod_id), keys.pod(pod.pod_id),
                keys.pods, pod.blocks_key(keys), pod.generation, 60_000, pod.pod_id, *fields,
            )  # fmt: skip
        source = RedisLoadSource(server.url)
        load = source.read()
        hosts = sorted(source.pod_hosts())
    assert load.prefill == RoleLoad(1, 2, 3, 60, 100)
    assert load.decode == RoleLoad(2, 10, 1, 200, 400)
    assert hosts == ["10.0.0.1", "10.0.0.2", "10.0.0.3"]


def test_autoscale_command_runs_against_metrics_and_the_api(capsys) -> None:
    from splitserve.planner.__main__ import main as plan_main

    pods = MetricsServer("decode")
    try:
        with FakeApiServer({DEPLOYMENTS.prefill: 1, DEPLOYMENTS.decode: 2}) as api:
            pods.waiting.set(4)
            status = plan_main(
                [
                    "autoscale", "--namespace", NAMESPACE,
                    "--prefill-deployment", DEPLOYMENTS.prefill,
                    "--decode-deployment", DEPLOYMENTS.decode,
                    "--metrics-url", pods.url, "--kube-api-url", api.url,
                    "--breach-readings", "2", "--interval", "0.01", "--max-readings", "2",
                ]
            )  # fmt: skip
            patches = api.patches()
    finally:
        pods.close()
    assert status == 0
    out = capsys.readouterr().out
    assert "decode: scale 2 -> 3 (4 waiting on 1 decode pods for 2 readings)" in out
    assert [(p.path, p.body) for p in patches] == [
        (_patch_path(DEPLOYMENTS.decode), {"spec": {"replicas": 3}})
    ]
