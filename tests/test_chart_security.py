"""The chart's security wiring (docs/security.md), rendered by Helm's own engine as
tests/test_helm_chart.py renders it: NetworkPolicies, TLS files and probes, secrets only as
mounted files, and values.schema.json on the new values."""

from __future__ import annotations

from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest

from .test_helm_chart import (
    KUBE_VERSIONS,
    by_kind,
    command_line,
    command_problems,
    containers_of,
    deployment_of,
    objects_of,
    render,
)

SECURE = {
    "tls": {"enabled": True, "certManager": {"enabled": True, "issuerRef": {"name": "our-ca"}}},
    "engine": {"kvTransport": "tcp", "kvAuth": {"existingSecret": "kv-secret"}},
    "redis": {"auth": {"existingSecret": "redis-password"}},
}


def _component_labels(objects: list[dict[str, Any]], component: str) -> dict[str, str]:
    deployment = deployment_of(objects, component)
    assert deployment is not None, component
    return deployment["spec"]["template"]["metadata"]["labels"]


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(key) == value for key, value in selector.items())


def _allowed(policy: dict[str, Any], port: int, objects, component: str) -> bool:
    """Whether `component`'s pods may reach `port` under `policy`'s ingress rules."""
    labels = _component_labels(objects, component) if component != "autoscaler" else {
        "app.kubernetes.io/component": "autoscaler",
        "app.kubernetes.io/instance": "demo",
        "app.kubernetes.io/name": "splitserve",
    }
    for rule in policy["spec"]["ingress"]:
        if port not in [p["port"] for p in rule.get("ports", [])]:
            continue
        peers = rule.get("from")
        if peers is None:
            return True
        if any(_selects(p.get("podSelector", {}).get("matchLabels", {}), labels) for p in peers):
            return True
    return False


def test_network_policies_let_only_the_right_parts_in():
    objects = objects_of(render({"autoscaler": {"enabled": True}}))
    policies = {
        name.removeprefix("demo-splitserve-"): policy
        for name, policy in by_kind(objects, "NetworkPolicy").items()
    }
    assert set(policies) == {"gateway", "prefill", "decode", "redis"}
    for component in ("gateway", "prefill", "decode"):
        selector = policies[component]["spec"]["podSelector"]["matchLabels"]
        assert _selects(selector, _component_labels(objects, component))
    decode, prefill, redis = policies["decode"], policies["prefill"], policies["redis"]
    parts = ("gateway", "prefill", "decode", "autoscaler")
    # decode gRPC: the gateway only; its KV port: prefill pods only.
    assert [p for p in parts if _allowed(decode, 50061, objects, p)] == ["gateway"]
    assert [p for p in parts if _allowed(decode, 50062, objects, p)] == ["prefill"]
    # prefill gRPC: the gateway, and decode pods asking for a remote prefill.
    assert [p for p in parts if _allowed(prefill, 50071, objects, p)] == ["gateway", "decode"]
    assert [p for p in parts if _allowed(prefill, 9090, objects, p)] == ["autoscaler"]
    assert [p for p in parts if _allowed(redis, 6379, objects, p)] == list(parts)
    assert not _allowed(decode, 9999, objects, "gateway")  # nothing else is open
    assert _allowed(policies["gateway"], 8000, objects, "decode")  # the public API: anyone


def _egress_allowed(policy: dict[str, Any], port: int, objects, component: str | None) -> bool:
    """Whether `policy`'s pods may reach `port` on `component`'s pods (None: an address that
    is no pod of ours, such as an external Redis) under its egress rules."""
    if component is None:
        labels: dict[str, str] = {}
    elif component == "redis":
        labels = {
            "app.kubernetes.io/component": "redis",
            "app.kubernetes.io/instance": "demo",
            "app.kubernetes.io/name": "splitserve",
        }
    else:
        labels = _component_labels(objects, component)
    for rule in policy["spec"].get("egress", []):
        if port not in [p["port"] for p in rule.get("ports", [])]:
            continue
        peers = rule.get("to")
        if peers is None:
            return True
        if component is not None and any(
            _selects(p.get("podSelector", {}).get("matchLabels", {}), labels) for p in peers
        ):
            return True
    return False


def _policies(values: dict[str, Any]) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
    objects = objects_of(render(values))
    policies = {
        name.removeprefix("demo-splitserve-"): policy
        for name, policy in by_kind(objects, "NetworkPolicy").items()
    }
    return policies, objects


API_SERVER = {"cidr": "10.0.0.10/32"}


def test_egress_policies_let_each_part_reach_only_its_peers_dns_and_redis():
    extra = {"to": [{"ipBlock": {"cidr": "10.9.0.0/16"}}], "ports": [{"port": 4317}]}
    egress = {"enabled": True, "extraTo": [extra], "apiServer": API_SERVER}
    policies, objects = _policies({"networkPolicy": {"egress": egress}})
    gateway, prefill, decode = (policies[c] for c in ("gateway", "prefill", "decode"))
    for policy in (gateway, prefill, decode):
        assert policy["spec"]["policyTypes"] == ["Ingress", "Egress"]
        assert _egress_allowed(policy, 53, objects, None)  # DNS, wherever the resolver is
        assert _egress_allowed(policy, 6379, objects, "redis")
        assert not _egress_allowed(policy, 6379, objects, None)  # the bundled Redis only
        assert extra in policy["spec"]["egress"]
    parts = ("gateway", "prefill", "decode")
    # gRPC: the gateway to both pools, decode pods to prefill's (remote prefill).
    assert [p for p in parts if _egress_allowed(gateway, 50071, objects, p)] == ["prefill"]
    assert [p for p in parts if _egress_allowed(gateway, 50061, objects, p)] == ["decode"]
    assert [p for p in parts if _egress_allowed(decode, 50071, objects, p)] == ["prefill"]
    assert not any(_egress_allowed(decode, 50061, objects, p) for p in parts)
    # KV pages: prefill pods to decode's KV port, nobody else; prefill reaches no gRPC.
    assert [p for p in parts if _egress_allowed(prefill, 50062, objects, p)] == ["decode"]
    assert not _egress_allowed(gateway, 50062, objects, "decode")
    assert not any(_egress_allowed(prefill, port, objects, p)
                   for port in (50061, 50071) for p in parts)  # fmt: skip
    assert not _egress_allowed(gateway, 443, objects, None)  # nothing else leaves
    # Prefill and decode pods read their node's labels from the API server (topology).
    for policy, reaches_api in ((gateway, False), (prefill, True), (decode, True)):
        api_rules = [rule for rule in policy["spec"]["egress"]
                     if {"ipBlock": API_SERVER} in rule.get("to", [])]  # fmt: skip
        assert bool(api_rules) == reaches_api
        if reaches_api:
            assert [p["port"] for p in api_rules[0]["ports"]] == [443, 6443]
    for policy in policies.values():  # Kubernetes' own schema, strictly
        kubernetes_validate.validate(policy, KUBE_VERSIONS[-1], strict=True)


@pytest.mark.parametrize(("url", "port"), [("redis://cache.example:6380/0", 6380),
                                           ("rediss://user@cache.example", 6379),
                                           ("redis://10.0.0.5:7000", 7000)])  # fmt: skip
def test_egress_reaches_an_external_redis_on_its_urls_port(url, port):
    values = {"redis": {"enabled": False, "external": {"url": url}},
              "topology": {"discover": False, "region": "r1", "zone": "z1"},
              "networkPolicy": {"egress": {"enabled": True}}}  # fmt: skip
    policies, objects = _policies(values)
    assert "redis" not in policies
    for component in ("gateway", "prefill", "decode"):
        assert _egress_allowed(policies[component], port, objects, None)


def test_egress_with_topology_discovery_needs_the_api_servers_address():
    """Pods read their node's labels from the Kubernetes API at start: egress policies that
    shut it out would leave them without a region or zone, so rendering refuses."""
    with pytest.raises(helm.HelmRenderError, match="apiServer.cidr"):
        render({"networkPolicy": {"egress": {"enabled": True}}})
    static = {"topology": {"discover": False, "region": "r1", "zone": "z1"},
              "networkPolicy": {"egress": {"enabled": True}}}  # fmt: skip
    policies, _ = _policies(static)
    rules = [rule for policy in policies.values() for rule in policy["spec"].get("egress", [])]
    assert rules and all(rule.get("to", [{}])[0].get("ipBlock") is None for rule in rules)


def test_egress_policies_are_off_by_default():
    policies, _ = _policies({})
    assert all(policy["spec"]["policyTypes"] == ["Ingress"] for policy in policies.values())
    assert all("egress" not in policy["spec"] for policy in policies.values())


def test_network_policies_can_be_turned_off():
    objects = objects_of(render({"networkPolicy": {"enabled": False}}))
    assert not by_kind(objects, "NetworkPolicy")


def test_secure_values_validate_and_mount_secrets_as_files_only():
    objects = objects_of(render(SECURE))
    custom = []
    for obj in objects:
        try:
            kubernetes_validate.validate(obj, KUBE_VERSIONS[-1], strict=True)
        except kubernetes_validate.SchemaNotFoundError:
            custom.append(obj["kind"])
    assert custom == ["Certificate"]
    certificate = by_kind(objects, "Certificate")["demo-splitserve-tls"]
    assert certificate["spec"]["secretName"] == "demo-splitserve-tls"
    assert set(certificate["spec"]["usages"]) == {"server auth", "client auth"}
    assert "splitserve.internal" in certificate["spec"]["dnsNames"]
    for component, container in containers_of(objects):
        for variable in container.get("env", []):
            # A secret reaches a container as a file or a secretKeyRef, never a literal value.
            assert "password" not in variable.get("value", "").lower() or variable[
                "value"
            ].startswith("/"), (component, variable)
        argv = command_line(container, objects)
        assert not any("REDIS_PASSWORD" in arg for arg in argv[1:-1] if "printf" not in arg)
        if component in ("prefill", "decode", "gateway"):
            assert command_problems(argv) == [], component
            mounts = {m["name"]: m for m in container["volumeMounts"]}
            assert mounts["tls"]["readOnly"] is True
            env = {v["name"]: v.get("value") for v in container["env"]}
            assert env["SPLITSERVE_TLS_CA"] == "/etc/splitserve/tls/ca.crt"
        if component in ("prefill", "decode"):
            assert "kv-auth" in {m["name"] for m in container["volumeMounts"]}
            # kubelet probes the plaintext health-only port, which the pod is told to open.
            assert container["readinessProbe"]["grpc"]["port"] == 50090
            assert argv[argv.index("--health-port") + 1] == "50090"


def test_redis_password_never_reaches_a_command_line():
    objects = objects_of(render({"redis": {"auth": {"existingSecret": "redis-password"}}}))
    redis = next(c for name, c in containers_of(objects) if name == "redis")
    assert "--requirepass" not in redis.get("args", [])
    assert "$(REDIS_PASSWORD)" not in " ".join(redis["command"] + redis.get("args", []))


def test_gateway_mounts_its_api_key_file_and_is_told_where():
    objects = objects_of(render({"gateway": {"apiKeys": {"secretName": "keys"}}}))
    gateway = deployment_of(objects, "gateway")
    assert gateway is not None
    container = gateway["spec"]["template"]["spec"]["containers"][0]
    path = container["args"][container["args"].index("--api-keys") + 1]
    assert path == "/etc/splitserve/api-keys/api-keys.yaml"
    volumes = {v["name"]: v for v in gateway["spec"]["template"]["spec"]["volumes"]}
    assert volumes["api-keys"]["secret"]["secretName"] == "keys"
    default = deployment_of(objects_of(render({})), "gateway")
    assert default is not None
    assert "--api-keys" not in default["spec"]["template"]["spec"]["containers"][0]["args"]


@pytest.mark.parametrize(
    ("values", "where"),
    [
        ({"tls": {"enabled": True, "certManager": {"enabled": True}}}, "name"),
        ({"networkPolicy": {"allowAll": True}}, "allowAll"),
        ({"tls": {"healthPort": 0}}, "healthPort"),
    ],
)
def test_schema_rejects_bad_security_values(values, where):
    with pytest.raises(helm.HelmValuesError) as error:
        render(values)
    assert where in str(error.value)


def test_kv_auth_with_ucx_is_refused():
    with pytest.raises(Exception, match="kvAuth needs engine.kvTransport tcp"):
        render({"engine": {"kvTransport": "ucx", "kvAuth": {"existingSecret": "kv"}}})


def test_redis_over_tls_serves_tls_only_and_every_client_has_the_files():
    values = {**SECURE, "redis": {"auth": {"existingSecret": "redis-password"}, "tls": True}}
    objects = objects_of(render({**values, "autoscaler": {"enabled": True}}))
    redis_container = next(c for name, c in containers_of(objects) if name == "redis")
    args = redis_container["args"]
    assert args[args.index("--port") + 1] == "0"  # no plaintext port
    assert args[args.index("--tls-port") + 1] == "6379"
    assert args[args.index("--tls-auth-clients") + 1] == "yes"  # tls.mutual's default
    assert "--tls" in redis_container["readinessProbe"]["exec"]["command"]
    certificate = by_kind(objects, "Certificate")["demo-splitserve-tls"]
    assert "demo-splitserve-redis" in certificate["spec"]["dnsNames"]
    clients = 0
    for component, container in containers_of(objects):
        env = {v["name"]: v.get("value") for v in container.get("env", [])}
        if "REDIS_URL" not in env:
            continue
        clients += 1
        url = env["REDIS_URL"]
        assert url.startswith("rediss://demo-splitserve-redis:6379/0?"), (component, url)
        mounted = {m["mountPath"] for m in container["volumeMounts"]}
        for path in ("/etc/splitserve/tls/ca.crt", "/etc/splitserve/tls/tls.crt"):
            assert path in url
            assert "/etc/splitserve/tls" in mounted, component
    assert clients == 4  # gateway, prefill, decode, autoscaler


def test_redis_tls_without_the_charts_certificate_is_refused():
    with pytest.raises(Exception, match="redis.tls needs tls.enabled"):
        render({"redis": {"tls": True}})
