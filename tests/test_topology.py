"""discover_topology against a local HTTP server that answers GET /api/v1/nodes/<name> the way
the Kubernetes API server does (a Node object, or a Status with 403/404)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from kubernetes import client

from splitserve.pod.topology import (
    REGION_LABEL,
    ZONE_LABEL,
    Topology,
    TopologyLookupError,
    discover_topology,
)

TOKEN = "service-account-token"
NODES = {
    "gpu-node-1": {
        REGION_LABEL: "eu-west-4",
        ZONE_LABEL: "eu-west-4b",
        "kubernetes.io/os": "linux",
    },
    "zone-only": {ZONE_LABEL: "rack-7"},
    "bare-metal": {},
}
FORBIDDEN_NODE = "secret-node"


class FakeApiServer(BaseHTTPRequestHandler):
    requests: list[tuple[str, str | None]] = []  # (path, Authorization header)

    def do_GET(self) -> None:
        type(self).requests.append((self.path, self.headers.get("Authorization")))
        prefix = "/api/v1/nodes/"
        name = self.path.removeprefix(prefix) if self.path.startswith(prefix) else None
        if name == FORBIDDEN_NODE:
            self._answer(403, _status(403, "Forbidden", f'nodes "{name}" is forbidden'))
        elif name in NODES:
            self._answer(200, _node(name, NODES[name]))
        else:
            self._answer(404, _status(404, "NotFound", f'nodes "{name}" not found'))

    def _answer(self, code: int, body: dict) -> None:
        payload = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args) -> None:  # keep the test output quiet
        pass


def _node(name: str, labels: dict[str, str]) -> dict:
    metadata: dict = {"name": name, "uid": f"uid-{name}", "resourceVersion": "1"}
    if labels:
        metadata["labels"] = labels
    return {"kind": "Node", "apiVersion": "v1", "metadata": metadata, "spec": {}, "status": {}}


def _status(code: int, reason: str, message: str) -> dict:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


@pytest.fixture(scope="module")
def api_server() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeApiServer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture
def configuration(api_server) -> client.Configuration:
    FakeApiServer.requests.clear()
    configuration = client.Configuration(host=api_server)
    configuration.api_key = {"authorization": TOKEN}
    configuration.api_key_prefix = {"authorization": "Bearer"}
    return configuration


def test_reads_region_and_zone_from_the_node_labels(configuration):
    topology = discover_topology("gpu-node-1", configuration)
    assert topology == Topology(
        region=NODES["gpu-node-1"][REGION_LABEL], zone=NODES["gpu-node-1"][ZONE_LABEL]
    )
    assert FakeApiServer.requests == [("/api/v1/nodes/gpu-node-1", f"Bearer {TOKEN}")]


def test_missing_labels_are_empty_strings(configuration):
    assert discover_topology("zone-only", configuration) == Topology(region="", zone="rack-7")
    assert discover_topology("bare-metal", configuration) == Topology(region="", zone="")


@pytest.mark.parametrize(("node", "status"), [("no-such-node", 404), (FORBIDDEN_NODE, 403)])
def test_a_failed_lookup_names_the_node_and_the_status(configuration, node, status):
    with pytest.raises(TopologyLookupError, match=rf"{node}.*HTTP {status}"):
        discover_topology(node, configuration)


def test_an_unreachable_api_server_is_a_lookup_error():
    configuration = client.Configuration(host="http://127.0.0.1:1")
    configuration.retries = 0
    with pytest.raises(TopologyLookupError, match="unreachable-node"):
        discover_topology("unreachable-node", configuration)


def test_outside_a_cluster_the_default_configuration_is_a_lookup_error(monkeypatch):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_PORT", raising=False)
    with pytest.raises(TopologyLookupError, match="not running in a Kubernetes pod"):
        discover_topology("gpu-node-1")


def test_an_empty_node_name_is_a_value_error(configuration):
    with pytest.raises(ValueError, match="node_name"):
        discover_topology("", configuration)
    assert FakeApiServer.requests == []
