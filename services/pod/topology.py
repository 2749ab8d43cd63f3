"""Where a pod runs: its node's region and zone, read from the node's well-known topology labels
through the Kubernetes API.

A pod knows its node's name (the chart passes `spec.nodeName` as NODE_NAME / --node-name) but
not the node's labels: the downward API does not expose them, so the pod asks the API server,
with the chart's ClusterRole that grants `get` on nodes.
"""

from __future__ import annotations

from dataclasses import dataclass

import urllib3
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from kubernetes.config.config_exception import ConfigException

REGION_LABEL = "topology.kubernetes.io/region"
ZONE_LABEL = "topology.kubernetes.io/zone"
# A pod asks once, at start; a slow API server must not hold the pod's start up for long.
REQUEST_TIMEOUT_SECONDS = 5.0


@dataclass(frozen=True)
class Topology:
    region: str  # "" when the node carries no region label
    zone: str  # "" when the node carries no zone label


class TopologyLookupError(RuntimeError):
    """The node's labels could not be read (not in a cluster, no RBAC, no such node, API down)."""


def discover_topology(
    node_name: str, configuration: client.Configuration | None = None
) -> Topology:
    """The region and zone labels of node `node_name`.

    `configuration` says how to reach the API server; by default the pod's in-cluster service
    account (token, CA and address mounted by Kubernetes). A node without the labels gives
    empty strings; a failed lookup raises `TopologyLookupError` naming the node.
    """
    if not node_name:
        raise ValueError("node_name must name a Kubernetes node, got an empty string")
    configuration = configuration or _in_cluster_configuration()
    try:
        with client.ApiClient(configuration) as api:
            node = client.CoreV1Api(api).read_node(
                node_name, _request_timeout=REQUEST_TIMEOUT_SECONDS
            )
    except ApiException as error:
        raise TopologyLookupError(
            f"reading node {node_name!r}: HTTP {error.status} {error.reason}"
        ) from error
    except urllib3.exceptions.HTTPError as error:
        raise TopologyLookupError(f"reading node {node_name!r}: {error}") from error
    metadata = node.metadata  # optional in the API's schema
    labels = (metadata.labels if metadata is not None else None) or {}
    return Topology(region=labels.get(REGION_LABEL, ""), zone=labels.get(ZONE_LABEL, ""))


def _in_cluster_configuration() -> client.Configuration:
    configuration = client.Configuration()
    try:
        config.load_incluster_config(client_configuration=configuration)
    except ConfigException as error:
        raise TopologyLookupError(f"not running in a Kubernetes pod: {error}") from error
    return configuration
