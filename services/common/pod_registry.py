"""A pod's registry flags (the Helm chart renders them as spelled here) and starting its
`RegistryPublisher` when `--redis-url` is given.

Flags and their defaults: `--redis-url` ($REDIS_URL, else no registry; password from
$REDIS_PASSWORD), `--region` / `--zone` ($SPLITSERVE_REGION / $SPLITSERVE_ZONE, else the node's
topology labels when `--node-name` ($NODE_NAME) is given, else ""), `--advertise-host` (the
address others dial for this pod's gRPC: $POD_IP, else the bind host made reachable).
"""

from __future__ import annotations

import argparse
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.common.kv_event_publisher import RegistryPublisher, new_generation
from services.common.registry import PodRecord, connect

if TYPE_CHECKING:
    from services.common.pod import PodCore

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Place:
    region: str
    zone: str


def add_registry_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("registry (Redis)")
    group.add_argument(
        "--redis-url",
        default=os.environ.get("REDIS_URL") or None,
        help="register here and publish prefix-cache events (default: $REDIS_URL, else none)",
    )
    group.add_argument("--region", default=os.environ.get("SPLITSERVE_REGION", ""))
    group.add_argument("--zone", default=os.environ.get("SPLITSERVE_ZONE", ""))
    group.add_argument(
        "--node-name",
        default=os.environ.get("NODE_NAME") or None,
        help="Kubernetes node: its topology labels fill an empty --region/--zone",
    )
    group.add_argument(
        "--advertise-host",
        default=os.environ.get("POD_IP") or None,
        help="the address others dial for this pod's gRPC (default: $POD_IP, else --host)",
    )


def pod_place(args: argparse.Namespace) -> Place:
    """--region/--zone, with the node's topology labels filling whichever is empty."""
    region, zone = args.region or "", args.zone or ""
    if (region and zone) or not args.node_name:
        return Place(region, zone)
    try:
        from services.common.topology import discover_topology
    except ImportError:
        return Place(region, zone)
    try:
        topology = discover_topology(args.node_name)
    except Exception as error:  # the Kubernetes API is optional: any failure keeps ""
        logger.warning("no topology labels for node %s: %s", args.node_name, error)
        return Place(region, zone)
    return Place(region or topology.region, zone or topology.zone)


def advertise_address(args: argparse.Namespace, port: int) -> str:
    from services.common.pod import reachable_host

    return f"{args.advertise_host or reachable_host(args.host)}:{port}"


async def start_registry(
    args: argparse.Namespace, core: PodCore, port: int
) -> RegistryPublisher | None:
    """Starts heartbeating and publishing when --redis-url is set; None otherwise."""
    if not args.redis_url:
        return None
    address = advertise_address(args, port)
    generation = new_generation()
    node = args.node_name or address.rsplit(":", 1)[0]

    def record() -> PodRecord:
        stats = core.stats()
        identity, engine = stats.identity, stats.engine
        return PodRecord(
            worker_id=identity.worker_id,
            role=identity.role,
            address=address,
            generation=generation,
            model=identity.model_name,
            kv_address=identity.kv_address,
            kv_transport=identity.kv_transport,
            region=identity.region,
            zone=identity.zone,
            node=node,
            block_size=stats.block_size,
            hash_namespace=core.llm.config.cache.hash_namespace,
            kv_blocks_total=engine.num_kv_blocks_total,
            kv_blocks_free=engine.num_kv_blocks_free,
            num_running=engine.num_running,
            num_waiting=engine.num_waiting,
            recent_ttft_s=core.metrics.recent_ttft.value or 0.0,
            recent_itl_s=core.metrics.recent_itl.value or 0.0,
        )

    publisher = RegistryPublisher(connect(args.redis_url), core.llm, record)
    await publisher.start()
    logger.info("registering in Redis as %s (generation %d)", address, generation)
    return publisher
