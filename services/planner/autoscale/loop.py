"""`splitserve plan autoscale`: the control loop around `controller.Autoscaler`.

Every `--interval` seconds: read the load (Redis registry and/or pod metrics), read both
Deployments' replicas through their scale subresource, decide, and PATCH the scale of a
Deployment whose count changes (with `--dry-run`, print the decision instead). One line per
reading goes to stdout. The RBAC it needs: get and patch on `deployments/scale` in its
namespace (the chart's Role grants exactly that).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from splitserve.common.redis_auth import add_redis_password_flag, use_redis_password_file
from splitserve.planner.autoscale.controller import (
    ROLES,
    Autoscaler,
    Bounds,
    PolicySettings,
    RoleDecision,
)
from splitserve.planner.autoscale.load import (
    CombinedLoadSource,
    LoadSnapshot,
    LoadSource,
    MetricsLoadSource,
    RedisLoadSource,
)
from splitserve.planner.profile import DEFAULT_MARGIN, load_profile


class DeploymentScaler:
    """Reads and patches `deployments/{name}/scale` in one namespace."""

    def __init__(self, namespace: str, api_url: str | None = None) -> None:
        from kubernetes import client

        self.namespace = namespace
        self._apps = client.AppsV1Api(_api_client(api_url))

    def replicas(self, deployment: str) -> int:
        scale = self._apps.read_namespaced_deployment_scale(deployment, self.namespace)
        spec = scale.spec  # optional in the API's schema
        return (spec.replicas or 0) if spec is not None else 0

    def scale(self, deployment: str, replicas: int) -> None:
        body = {"spec": {"replicas": replicas}}
        self._apps.patch_namespaced_deployment_scale(deployment, self.namespace, body)


def _api_client(api_url: str | None):
    """The API server at `api_url` (e.g. `kubectl proxy`'s), else the in-cluster service
    account, else ~/.kube/config."""
    from kubernetes import client, config

    if api_url is not None:
        configuration = client.Configuration()
        configuration.host = api_url
        return client.ApiClient(configuration)
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.ApiClient()


@dataclass(frozen=True)
class Deployments:
    prefill: str
    decode: str

    def name(self, role: str) -> str:
        return self.prefill if role == "prefill" else self.decode


class Controller:
    """One `tick` = one reading, decision and (unless dry-run) patch."""

    def __init__(
        self,
        autoscaler: Autoscaler,
        source: LoadSource,
        scaler: DeploymentScaler,
        deployments: Deployments,
        dry_run: bool = False,
        clock: Callable[[], float] = time.monotonic,
        out: Callable[[str], None] = print,
    ) -> None:
        self.autoscaler = autoscaler
        self.source = source
        self.scaler = scaler
        self.deployments = deployments
        self.dry_run = dry_run
        self._clock = clock
        self._out = out

    def tick(self) -> list[RoleDecision]:
        """One reading; a failure to read the load or to reach the API is printed and skips
        this reading (the next one tries again), never ends the loop."""
        try:
            load = self.source.read()
        except OSError as error:
            self._out(f"[autoscale] cannot read the load ({error}); no change this time")
            return []
        try:
            current = {role: self.scaler.replicas(self.deployments.name(role)) for role in ROLES}
            decisions = self.autoscaler.decide(self._clock(), load, current)
            for decision in decisions:
                self._apply(decision)
        except _api_errors() as error:
            self._out(f"[autoscale] Kubernetes API: {_short(error)}; no change this time")
            return []
        self._out(_line(load, decisions, self.dry_run))
        return decisions

    def _apply(self, decision: RoleDecision) -> None:
        if decision.changes and not self.dry_run:
            self.scaler.scale(self.deployments.name(decision.role), decision.desired)

    def run(self, interval_s: float, max_ticks: int | None = None) -> None:
        ticks = 0
        while max_ticks is None or ticks < max_ticks:
            started = self._clock()
            self.tick()
            ticks += 1
            time.sleep(max(interval_s - (self._clock() - started), 0.0))


def _api_errors() -> tuple[type[BaseException], ...]:
    # lazy: the Kubernetes client and its transport's errors, only when autoscaling
    from kubernetes.client.exceptions import OpenApiException
    from urllib3.exceptions import HTTPError

    return OpenApiException, HTTPError


def _short(error: BaseException) -> str:
    status = getattr(error, "status", None)
    reason = getattr(error, "reason", None)
    return f"HTTP {status} {reason}" if status else str(error).splitlines()[0]


def _line(load: LoadSnapshot, decisions: list[RoleDecision], dry_run: bool) -> str:
    def fmt(value: float | None) -> str:
        return "-" if value is None else f"{value * 1e3:.0f}ms"

    parts = [
        f"TTFT p90 {fmt(load.ttft_s)} ITL p90 {fmt(load.itl_s)}",
        f"waiting P/D {load.prefill.num_waiting}/{load.decode.num_waiting}",
        f"KV {load.decode.kv_usage:.0%}",
    ]
    for d in decisions:
        verb = ("would scale" if dry_run else "scale") if d.changes else "keep"
        target = f"{d.current} -> {d.desired}" if d.changes else f"{d.current}"
        parts.append(f"{d.role}: {verb} {target} ({d.reason})")
    return f"[autoscale {time.strftime('%H:%M:%S')}] " + "; ".join(parts)


# ---- from the command line ------------------------------------------------------------------


def load_source(args: argparse.Namespace) -> LoadSource:
    use_redis_password_file(args.redis_password_file)
    redis_source = RedisLoadSource(args.redis_url) if args.redis_url else None
    urls = list(args.metrics_url or [])
    if redis_source is not None and args.pod_metrics_port:
        port = args.pod_metrics_port

        def pod_urls() -> list[str]:
            return urls + [f"http://{host}:{port}/metrics" for host in redis_source.pod_hosts()]

        metrics: MetricsLoadSource | None = MetricsLoadSource(pod_urls)
    else:
        metrics = MetricsLoadSource(lambda: urls) if urls else None
    if redis_source is not None and metrics is not None:
        return CombinedLoadSource(redis_source, metrics)
    if redis_source is not None:
        return redis_source
    if metrics is not None:
        return metrics
    raise ValueError("give --redis-url (or $REDIS_URL) and/or --metrics-url for the live load")


def run_autoscale(args: argparse.Namespace) -> int:
    settings = PolicySettings(
        ttft_slo_s=args.ttft_slo,
        itl_slo_s=args.itl_slo,
        prefill=Bounds(args.min_prefill, args.max_prefill),
        decode=Bounds(args.min_decode, args.max_decode),
        cooldown_s=args.cooldown,
        breach_readings=args.breach_readings,
        idle_readings=args.idle_readings,
        attainment=args.attainment,
        confidence=args.confidence,
        max_remote_prefill_tokens=args.max_remote_prefill_tokens,
        pods_per_host=args.pods_per_host,
    )
    if args.interval <= 0:
        raise ValueError("--interval must be > 0 seconds")
    profile = load_profile(args.profile).with_margin(args.margin) if args.profile else None
    source = load_source(args)
    scaler = DeploymentScaler(args.namespace or _own_namespace(), args.kube_api_url)
    deployments = Deployments(args.prefill_deployment, args.decode_deployment)
    controller = Controller(
        Autoscaler(settings, profile), source, scaler, deployments, args.dry_run
    )
    print(f"[autoscale] {deployments} in {scaler.namespace}, every {args.interval:g} s", flush=True)
    with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C is the way to stop it
        controller.run(args.interval, args.max_readings)
    return 0


def _own_namespace() -> str:
    """The pod's namespace (service account mount), else $POD_NAMESPACE, else default."""
    path = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
    try:
        with open(path) as file:
            return file.read().strip()
    except OSError:
        return os.environ.get("POD_NAMESPACE", "default")


def add_autoscale_flags(sub: argparse.ArgumentParser) -> None:
    sub.add_argument("--namespace", default=None, help="of the Deployments (default: its own)")
    sub.add_argument("--prefill-deployment", required=True, help="the prefill Deployment's name")
    sub.add_argument("--decode-deployment", required=True, help="the decode Deployment's name")
    sub.add_argument("--profile", default=None, metavar="PATH", help="a pod profile (JSON)")
    sub.add_argument(
        "--margin",
        type=float,
        default=DEFAULT_MARGIN,
        help="the profile's times are taken this much slower, as recommend's --margin",
    )
    sub.add_argument(
        "--redis-url",
        default=os.environ.get("REDIS_URL") or None,
        help="the pod registry (default: $REDIS_URL)",
    )
    add_redis_password_flag(sub)
    sub.add_argument(
        "--metrics-url",
        action="append",
        default=None,
        metavar="URL",
        help="a /metrics endpoint to scrape for TTFT, ITL and rates (repeatable)",
    )
    sub.add_argument(
        "--pod-metrics-port",
        type=int,
        default=0,
        help="also scrape http://<pod>:PORT/metrics of every pod in the registry",
    )
    sub.add_argument("--ttft-slo", type=float, default=2.0, help="seconds (p90 target)")
    sub.add_argument("--itl-slo", type=float, default=0.2, help="seconds (p90 target)")
    sub.add_argument("--min-prefill", type=int, default=1)
    sub.add_argument("--max-prefill", type=int, default=8)
    sub.add_argument("--min-decode", type=int, default=1)
    sub.add_argument("--max-decode", type=int, default=8)
    sub.add_argument("--cooldown", type=float, default=120.0, help="seconds between changes")
    sub.add_argument("--interval", type=float, default=15.0, help="seconds between readings")
    sub.add_argument("--breach-readings", type=int, default=3, help="in a row, to scale up")
    sub.add_argument("--idle-readings", type=int, default=6, help="in a row, to scale down")
    sub.add_argument(
        "--attainment", type=float, default=0.9, help="the model's target, as recommend's"
    )
    sub.add_argument(
        "--confidence", type=float, default=0.8, help="the model's confidence, as recommend's"
    )
    sub.add_argument(
        "--max-remote-prefill-tokens",
        type=int,
        default=0,
        help="the decode pods' flag, for the model (as recommend's)",
    )
    sub.add_argument(
        "--pods-per-host", type=int, default=1, help="pods sharing a machine (as recommend's)"
    )
    sub.add_argument("--dry-run", action="store_true", help="print decisions, patch nothing")
    sub.add_argument(
        "--kube-api-url", default=None, help="API server URL (default: in-cluster, else kubeconfig)"
    )
    sub.add_argument("--max-readings", type=int, default=None, help=argparse.SUPPRESS)
