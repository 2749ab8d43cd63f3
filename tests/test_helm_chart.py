"""The Helm chart, rendered by Helm's own Go engine (helm-python-sdk bundles it; no cluster, no
helm binary) for the default values and every file in charts/splitserve/examples/.

- Every rendered object validates against the Kubernetes OpenAPI schemas (kubernetes-validate,
  offline) for the oldest Kubernetes the chart supports and the newest the validator knows.
- Every container's command line, after Kubernetes' $(VAR) expansion from its environment and
  the engine ConfigMap, is accepted by that service's real argument parser.
- The rendered manifests equal the committed golden files. After an intended change, regenerate
  them with `UPDATE_GOLDEN=1 python -m pytest tests/test_helm_chart.py` and review the diff.
- values.schema.json rejects bad values, and objects refer to each other consistently.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import io
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
CHART_DIR = REPO / "charts" / "splitserve"
EXAMPLES_DIR = CHART_DIR / "examples"
GOLDEN_DIR = Path(__file__).resolve().parent / "golden" / "helm"
RELEASE = "demo"
NAMESPACE = "serving"
# The oldest Kubernetes Chart.yaml's kubeVersion admits, and the newest the validator knows.
KUBE_VERSIONS = ("1.30.0", kubernetes_validate.latest_version())
CASES = ("default", *sorted(path.stem for path in EXAMPLES_DIR.glob("*.yaml")))
# What the downward API would fill in for $(VAR) expansion.
FIELD_VALUES = {
    "metadata.name": "demo-pod-0",
    "metadata.namespace": NAMESPACE,
    "status.podIP": "10.1.2.3",
    "spec.nodeName": "node-a",
}
SECRET_VALUE = "from-a-secret"
ENV_REFERENCE = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


# ---- rendering ------------------------------------------------------------------------------


@functools.cache
def _chart() -> helm.Chart:
    return helm.Chart.load(CHART_DIR)


def case_values(case: str) -> dict[str, Any]:
    if case == "default":
        return {}
    # Helm's own YAML reading, as `helm install -f` does it.
    return helm.values_from_yaml((EXAMPLES_DIR / f"{case}.yaml").read_text())


def render(values: dict[str, Any] | None = None) -> dict[str, str]:
    """Template path -> rendered text, as `helm template demo --namespace serving` renders."""
    return _chart().render(values=values or {}, name=RELEASE, namespace=NAMESPACE)


@functools.cache
def _rendered_case(case: str) -> dict[str, str]:
    return render(case_values(case))


def manifest_text(rendered: dict[str, str]) -> str:
    """The manifests as one YAML stream in template order, NOTES.txt left out (as `helm
    template` prints them)."""
    documents = [
        f"# Source: {path}\n{text.strip()}\n"
        for path, text in sorted(rendered.items())
        if path.endswith((".yaml", ".yml")) and text.strip()
    ]
    return "---\n" + "---\n".join(documents)


def objects_of(rendered: dict[str, str]) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(manifest_text(rendered)) if doc]


@functools.cache
def _case_objects(case: str) -> tuple[dict[str, Any], ...]:
    return tuple(objects_of(_rendered_case(case)))


def case_objects(case: str) -> list[dict[str, Any]]:
    return list(_case_objects(case))


def by_kind(objects: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {obj["metadata"]["name"]: obj for obj in objects if obj["kind"] == kind}


def deployment_of(objects: list[dict[str, Any]], component: str) -> dict[str, Any] | None:
    for deployment in by_kind(objects, "Deployment").values():
        if deployment["metadata"]["labels"]["app.kubernetes.io/component"] == component:
            return deployment
    return None


def containers_of(objects: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(component, container) for every container of every Deployment."""
    for deployment in by_kind(objects, "Deployment").values():
        component = deployment["metadata"]["labels"]["app.kubernetes.io/component"]
        for container in deployment["spec"]["template"]["spec"]["containers"]:
            yield component, container


# ---- what Kubernetes does to a container's arguments ----------------------------------------


def container_env(container: dict[str, Any], objects: list[dict[str, Any]]) -> dict[str, str]:
    """The container's environment as the kubelet builds it: envFrom first, then env (later
    entries win; a value may reference earlier variables)."""
    config_maps = by_kind(objects, "ConfigMap")
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        name = source["configMapRef"]["name"]
        assert name in config_maps, f"envFrom names ConfigMap {name!r}, which is not rendered"
        env.update(config_maps[name]["data"])
    for variable in container.get("env", []):
        env[variable["name"]] = _env_value(variable, env, config_maps)
    return env


def _env_value(variable: dict[str, Any], env: dict[str, str], config_maps) -> str:
    if "value" in variable:
        return expand(variable["value"], env)
    source = variable["valueFrom"]
    if "fieldRef" in source:
        return FIELD_VALUES[source["fieldRef"]["fieldPath"]]
    if "secretKeyRef" in source:
        return SECRET_VALUE
    ref = source["configMapKeyRef"]
    return config_maps[ref["name"]]["data"][ref["key"]]


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion; an undefined reference stays as written (as it does)."""
    return ENV_REFERENCE.sub(lambda match: env.get(match.group(1), match.group(0)), text)


def command_line(container: dict[str, Any], objects: list[dict[str, Any]]) -> list[str]:
    env = container_env(container, objects)
    return [expand(token, env) for token in [*container["command"], *container.get("args", [])]]


# ---- the services' parsers ------------------------------------------------------------------


def service_module(argv: list[str]) -> tuple[str, list[str]]:
    """("splitserve.decode", its arguments) from ["python", "-m", "splitserve.decode", ...]."""
    assert argv[:2] == ["python", "-m"], f"containers run `python -m <module>`, not {argv[:3]}"
    return argv[2], argv[3:]


def _parser_for(parser: argparse.ArgumentParser, args: list[str]) -> argparse.ArgumentParser:
    """The (sub)parser that reads the flags: `splitserve.planner autoscale ...` descends into
    the autoscale subcommand."""
    for action in parser._actions:  # argparse offers no public view of its subcommands
        if isinstance(action, argparse._SubParsersAction) and args and args[0] in action.choices:
            return _parser_for(action.choices[args[0]], args[1:])
    return parser


def unknown_flags(parser: argparse.ArgumentParser, args: list[str]) -> list[str]:
    known = {flag for action in parser._actions for flag in action.option_strings}
    flags = [token.split("=", 1)[0] for token in args if token.startswith("--")]
    return [flag for flag in flags if flag not in known]


def parse_error(parser: argparse.ArgumentParser, args: list[str]) -> str | None:
    """What argparse says about `args` (bad types, choices, missing required flags), or None."""
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        try:
            parser.parse_args(args)
        except SystemExit:
            return stderr.getvalue().strip().splitlines()[-1]
    return None


def command_problems(argv: list[str]) -> list[str]:
    module, args = service_module(argv)
    try:
        main = importlib.import_module(f"{module}.__main__")
    except ImportError as error:
        return [f"{module} is not importable ({error}); it cannot run {args[:1]}"]
    parser = main.build_parser()
    unresolved = sorted({m.group(0) for arg in args for m in ENV_REFERENCE.finditer(arg)})
    if unresolved:
        return [f"{module}: undefined variables {unresolved}"]
    unknown = unknown_flags(_parser_for(parser, args), args)
    if unknown:
        return [f"{module} does not accept {sorted(set(unknown))}"]
    error = parse_error(parser, args)
    return [] if error is None else [f"{module} rejects {args}: {error}"]


# ---- tests: rendering, golden files, Kubernetes schemas -------------------------------------


@pytest.mark.parametrize("case", CASES)
def test_rendered_manifests_match_golden_files(case):
    text = manifest_text(_rendered_case(case))
    golden = GOLDEN_DIR / f"{case}.yaml"
    if os.environ.get("UPDATE_GOLDEN") == "1":
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_text(text)
    assert golden.exists(), f"no golden file {golden}; create it with UPDATE_GOLDEN=1"
    assert text == golden.read_text(), (
        f"the chart renders {case} differently from {golden.name}; if intended, regenerate "
        "with UPDATE_GOLDEN=1 python -m pytest tests/test_helm_chart.py and review the diff"
    )


def test_no_golden_file_without_a_case():
    stale = {path.stem for path in GOLDEN_DIR.glob("*.yaml")} - set(CASES)
    assert not stale, f"golden files for cases that no longer exist: {sorted(stale)}"


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
@pytest.mark.parametrize("case", CASES)
def test_every_object_validates_against_kubernetes_schemas(case, kube_version):
    objects = case_objects(case)
    assert objects
    custom = []
    for obj in objects:
        name = f"{obj['kind']}/{obj['metadata']['name']}"
        try:
            kubernetes_validate.validate(obj, kube_version, strict=True)
        except kubernetes_validate.SchemaNotFoundError:
            custom.append(obj)  # a CRD's kind: checked by test_service_monitors_select_...
        except kubernetes_validate.ValidationError as error:
            path = ".".join(str(part) for part in error.path)
            pytest.fail(f"{case}: {name} is invalid at {path}: {error.message}")
    assert {obj["kind"] for obj in custom} <= {"ServiceMonitor"}


@pytest.mark.parametrize("case", CASES)
def test_helm_lint_is_clean(case):
    report = helm.lint(CHART_DIR, case_values(case), strict=True, namespace=NAMESPACE)
    problems = [m for m in report["messages"] if m["severity"] >= 2] + report["errors"]
    assert not problems, problems


# ---- tests: commands the services accept ----------------------------------------------------


COMPONENT_MODULES = {
    "gateway": "splitserve.gateway",
    "prefill": "splitserve.prefill",
    "decode": "splitserve.decode",
    "autoscaler": "splitserve.planner",
}


@pytest.mark.parametrize("component", sorted(COMPONENT_MODULES))
def test_rendered_commands_are_accepted_by_the_services_parsers(component):
    checked, problems = 0, []
    for case in CASES:
        objects = case_objects(case)
        for name, container in containers_of(objects):
            if name != component:
                continue
            argv = command_line(container, objects)
            assert service_module(argv)[0] == COMPONENT_MODULES[component]
            problems += [f"[{case}] {problem}" for problem in command_problems(argv)]
            checked += 1
    assert checked, f"no case renders the {component}"
    assert not problems, "\n".join(problems)


def test_every_case_renders_each_serving_component_once():
    for case in CASES:
        components = [name for name, _ in containers_of(case_objects(case))]
        for component in ("gateway", "prefill", "decode"):
            assert components.count(component) == 1, (case, components)


# ---- tests: the schema ----------------------------------------------------------------------


BAD_VALUES = [
    ({"prefill": {"replicas": -1}}, "/prefill/replicas"),
    ({"decode": {"replicas": -3}}, "/decode/replicas"),
    ({"engine": {"kvTransport": "rdma"}}, "/engine/kvTransport"),
    ({"gateway": {"routingPolicy": "random"}}, "/gateway/routingPolicy"),
    ({"decode": {"speculative": {"method": "medusa"}}}, "/decode/speculative/method"),
    ({"decode": {"quantization": "int3"}}, "/decode/quantization"),
    ({"engine": {"kvCacheDtype": "fp8"}}, "/engine/kvCacheDtype"),
    ({"decode": {"kvCacheBytes": "eight gigabytes"}}, "/decode/kvCacheBytes"),
    ({"prefill": {"kvCacheMemoryFraction": 1.5}}, "/prefill/kvCacheMemoryFraction"),
    ({"decode": {"kvOffload": {"hostBytes": "lots"}}}, "/decode/kvOffload/hostBytes"),
    ({"decode": {"kvOffload": {"diskBytes": "50GB"}}}, "/decode/kvOffload/diskBytes"),
    ({"gateway": {"httpPort": 70000}}, "/gateway/httpPort"),
    ({"engine": {"blockSize": 0}}, "/engine/blockSize"),
    ({"prefill": {"gpu": 1}}, "'gpu' not allowed"),  # a misspelt key is not silently ignored
    ({"redis": {"enabled": False}}, "/redis/external/url"),
    ({"model": {"source": "pvc"}}, "/model/pvc/claimName"),
    ({"model": {"source": "s3"}}, "/model/source"),
    ({"gateway": {"service": {"type": "Ingress"}}}, "/gateway/service/type"),
    ({"decode": {"tensorParallelSize": 0}}, "/decode/tensorParallelSize"),
    ({"prefill": {"pipelineParallelSize": 0}}, "/prefill/pipelineParallelSize"),
    ({"decode": {"enableExpertParallel": "yes"}}, "/decode/enableExpertParallel"),
]


@pytest.mark.parametrize(("values", "where"), BAD_VALUES)
def test_schema_rejects_bad_values(values, where):
    with pytest.raises(helm.HelmValuesError) as error:
        render(values)
    assert where in str(error.value)


# ---- tests: what each example is for --------------------------------------------------------


def test_replicas_follow_each_roles_values():
    values = case_values("ratio-1p3d")
    objects = case_objects("ratio-1p3d")
    for role in ("prefill", "decode"):
        assert deployment_of(objects, role)["spec"]["replicas"] == values[role]["replicas"]
    assert values["prefill"]["replicas"] * 3 == values["decode"]["replicas"]


def test_settings_reach_the_pods_through_the_engine_config_map():
    values = case_values("ratio-1p3d")
    objects = case_objects("ratio-1p3d")
    decode_args = command_line(deployment_containers(objects, "decode")[0], objects)
    assert _flag(decode_args, "--speculative-method") == values["decode"]["speculative"]["method"]
    limit = values["decode"]["maxRemotePrefillTokens"]
    assert _flag(decode_args, "--max-remote-prefill-tokens") == str(limit)
    bound = values["decode"]["maxWaitingRequests"]
    assert _flag(decode_args, "--max-waiting-requests") == str(bound)
    model_path = f"{values['model']['pvc']['mountPath']}/{values['model']['path']}"
    for role in ("gateway", "prefill", "decode"):
        args = command_line(deployment_containers(objects, role)[0], objects)
        assert _flag(args, "--model") == model_path
        assert _flag(args, "--model-name") == values["model"]["name"]


def test_each_role_gets_its_own_quantization():
    # cpu-dev quantizes the decode pods only: prefill pods keep dense weights.
    objects = case_objects("cpu-dev")
    decode_args = command_line(deployment_containers(objects, "decode")[0], objects)
    prefill_args = command_line(deployment_containers(objects, "prefill")[0], objects)
    assert _flag(decode_args, "--quantization") == "gguf"
    assert _flag(prefill_args, "--quantization") == "none"


def test_cpu_dev_keeps_background_prompts_in_short_steps_on_both_roles():
    objects = case_objects("cpu-dev")
    for role in ("prefill", "decode"):
        args = command_line(deployment_containers(objects, role)[0], objects)
        assert _flag(args, "--max-background-prefill-tokens") == "128"
    default = case_objects("default")
    args = command_line(deployment_containers(default, "prefill")[0], default)
    assert _flag(args, "--max-background-prefill-tokens") is None  # a GPU: large steps


def test_both_roles_get_the_one_kv_cache_dtype():
    # Pages travel as they are stored: prefill and decode pods must agree, so it is one value.
    for case, expected in (("default", "auto"), ("cpu-dev", "int8")):
        objects = case_objects(case)
        for role in ("prefill", "decode"):
            args = command_line(deployment_containers(objects, role)[0], objects)
            assert _flag(args, "--kv-cache-dtype") == expected, (case, role)


def test_engine_settings_change_rolls_the_pods():
    before = objects_of(render())
    after = objects_of(render({"engine": {"blockSize": 32}}))
    for role in ("gateway", "prefill", "decode"):
        old = deployment_of(before, role)["spec"]["template"]["metadata"]["annotations"]
        new = deployment_of(after, role)["spec"]["template"]["metadata"]["annotations"]
        assert old["checksum/engine-config"] != new["checksum/engine-config"], role


def test_external_redis_replaces_the_bundled_one():
    values = case_values("external-redis")
    objects = case_objects("external-redis")
    assert deployment_of(objects, "redis") is None
    assert not [s for s in by_kind(objects, "Service") if s.endswith("-redis")]
    auth = values["redis"]["auth"]
    for component, container in containers_of(objects):
        assert (
            _flag(command_line(container, objects), "--redis-url")
            == (values["redis"]["external"]["url"])
        ), component
        password = {v["name"]: v for v in container["env"]}["REDIS_PASSWORD"]
        assert password["valueFrom"]["secretKeyRef"] == {
            "name": auth["existingSecret"],
            "key": auth["secretKey"],
        }
    assert all(
        ":" + SECRET_VALUE not in " ".join(command_line(c, objects))
        for _, c in containers_of(objects)
    ), "the password must not reach a command line"


def test_bundled_redis_serves_the_url_the_pods_dial():
    objects = case_objects("default")
    service = by_kind(objects, "Service")[f"{RELEASE}-splitserve-redis"]
    port = service["spec"]["ports"][0]["port"]
    for component, container in containers_of(objects):
        if component != "redis":
            url = _flag(command_line(container, objects), "--redis-url")
            assert url == f"redis://{service['metadata']['name']}:{port}/0", component


def test_multi_zone_spreads_every_role_across_zones():
    objects = case_objects("multi-zone")
    for role in ("gateway", "prefill", "decode"):
        pod = deployment_of(objects, role)["spec"]["template"]
        zone_spread = [
            c
            for c in pod["spec"]["topologySpreadConstraints"]
            if c["topologyKey"] == "topology.kubernetes.io/zone"
        ]
        assert len(zone_spread) == 1, role
        assert zone_spread[0]["whenUnsatisfiable"] == "DoNotSchedule"
        assert _selects(zone_spread[0]["labelSelector"]["matchLabels"], pod["metadata"]["labels"])


def test_cpu_dev_install_asks_for_no_gpu():
    objects = case_objects("cpu-dev")
    for component, container in containers_of(objects):
        resources = container.get("resources", {})
        for amounts in resources.values():
            assert "nvidia.com/gpu" not in amounts, component
        if component in ("prefill", "decode"):
            assert _flag(command_line(container, objects), "--kv-transport") == "tcp"
    for deployment in by_kind(objects, "Deployment").values():
        assert "tolerations" not in deployment["spec"]["template"]["spec"]


def test_gpu_install_asks_each_pod_for_its_gpus():
    objects = case_objects("default")
    for role in ("prefill", "decode"):
        container = deployment_containers(objects, role)[0]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 1


def test_tensor_parallel_pods_get_the_flag_and_a_gpu_per_rank():
    values = {"decode": {"tensorParallelSize": 2}}
    objects = objects_of(render(values))
    decode = deployment_containers(objects, "decode")[0]
    argv = command_line(decode, objects)
    assert _flag(argv, "--tensor-parallel-size") == "2"
    assert not command_problems(argv)
    assert decode["resources"]["limits"]["nvidia.com/gpu"] == 2
    prefill = deployment_containers(objects, "prefill")[0]
    assert "--tensor-parallel-size" not in command_line(prefill, objects)
    assert prefill["resources"]["limits"]["nvidia.com/gpu"] == 1


def test_expert_parallel_pods_get_the_flag():
    values = {"decode": {"tensorParallelSize": 2, "enableExpertParallel": True}}
    objects = objects_of(render(values))
    decode_argv = command_line(deployment_containers(objects, "decode")[0], objects)
    assert "--enable-expert-parallel" in decode_argv
    assert _flag(decode_argv, "--tensor-parallel-size") == "2"
    assert not command_problems(decode_argv)
    prefill_argv = command_line(deployment_containers(objects, "prefill")[0], objects)
    assert "--enable-expert-parallel" not in prefill_argv


def test_pipeline_parallel_pods_get_the_flag_and_a_gpu_per_stage():
    objects = objects_of(render({"prefill": {"pipelineParallelSize": 2}}))
    prefill = deployment_containers(objects, "prefill")[0]
    argv = command_line(prefill, objects)
    assert _flag(argv, "--pipeline-parallel-size") == "2"
    assert not command_problems(argv)
    assert prefill["resources"]["limits"]["nvidia.com/gpu"] == 2


def test_tensor_and_pipeline_parallel_pods_get_both_flags_and_a_gpu_per_rank():
    values = {"decode": {"tensorParallelSize": 2, "pipelineParallelSize": 2}}
    objects = objects_of(render(values))
    decode = deployment_containers(objects, "decode")[0]
    argv = command_line(decode, objects)
    assert _flag(argv, "--tensor-parallel-size") == "2"
    assert _flag(argv, "--pipeline-parallel-size") == "2"
    assert not command_problems(argv)
    assert decode["resources"]["limits"]["nvidia.com/gpu"] == 4  # 2 stages x 2 ranks


def test_autoscaler_owns_worker_replicas_and_may_scale_only_them():
    objects = case_objects("autoscaler")
    workers = {deployment_of(objects, role)["metadata"]["name"] for role in ("prefill", "decode")}
    for role in ("prefill", "decode"):
        assert "replicas" not in deployment_of(objects, role)["spec"], role
    (role,) = by_kind(objects, "Role").values()
    (rule,) = role["rules"]
    assert set(rule.pop("resourceNames")) == workers
    assert rule == {
        "apiGroups": ["apps"],
        "resources": ["deployments/scale"],
        "verbs": ["get", "patch"],
    }
    autoscaler = deployment_of(objects, "autoscaler")["spec"]["template"]["spec"]
    (binding,) = by_kind(objects, "RoleBinding").values()
    assert binding["subjects"][0]["name"] == autoscaler["serviceAccountName"]
    args = command_line(autoscaler["containers"][0], objects)
    assert {_flag(args, "--prefill-deployment"), _flag(args, "--decode-deployment")} == workers
    assert _flag(args, "--namespace") == NAMESPACE
    # The model simulates the decode pods with their own conditional-disaggregation limit.
    decode_args = command_line(
        deployment_of(objects, "decode")["spec"]["template"]["spec"]["containers"][0], objects
    )
    assert _flag(args, "--max-remote-prefill-tokens") == _flag(
        decode_args, "--max-remote-prefill-tokens"
    )


def test_default_install_has_no_autoscaler():
    objects = case_objects("default")
    assert deployment_of(objects, "autoscaler") is None
    assert not by_kind(objects, "Role")


# ---- tests: probes and ports ----------------------------------------------------------------


def test_worker_probes_ask_the_grpc_health_service_on_the_serving_port():
    from splitserve.v1 import worker_pb2

    services = worker_pb2.DESCRIPTOR.services_by_name
    for case in CASES:
        objects = case_objects(case)
        for role, service in (("prefill", "PrefillWorker"), ("decode", "DecodeWorker")):
            container = deployment_containers(objects, role)[0]
            port = int(_flag(command_line(container, objects), "--port"))
            assert _container_port(container, "grpc") == port
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                grpc_probe = container[probe]["grpc"]
                assert grpc_probe == {"port": port, "service": services[service].full_name}
            assert container["lifecycle"]["preStop"]["sleep"]["seconds"] > 0


def test_gateway_probes_its_http_port():
    from splitserve.gateway.api.http_app import ENDPOINTS

    for case in CASES:
        objects = case_objects(case)
        container = deployment_containers(objects, "gateway")[0]
        args = command_line(container, objects)
        assert _container_port(container, "http") == int(_flag(args, "--port"))
        assert _container_port(container, "grpc") == int(_flag(args, "--grpc-port"))
        assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
        assert container["livenessProbe"]["httpGet"]["path"] in ENDPOINTS


def test_pods_get_their_address_and_node_from_the_downward_api():
    objects = case_objects("default")
    for role in ("prefill", "decode"):
        container = deployment_containers(objects, role)[0]
        env = {v["name"]: v for v in container["env"]}
        assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
        args = command_line(container, objects)
        assert _flag(args, "--advertise-host") == FIELD_VALUES["status.podIP"]
        assert _flag(args, "--node-name") == FIELD_VALUES["spec.nodeName"]
    decode = deployment_containers(objects, "decode")[0]
    assert _flag(command_line(decode, objects), "--kv-host") == FIELD_VALUES["status.podIP"]


# ---- tests: objects refer to each other -----------------------------------------------------


@pytest.mark.parametrize("case", CASES)
def test_objects_refer_to_objects_that_exist(case):
    objects = case_objects(case)
    pods = [d["spec"]["template"] for d in by_kind(objects, "Deployment").values()]
    for service in by_kind(objects, "Service").values():
        selected = [
            p for p in pods if _selects(service["spec"]["selector"], p["metadata"]["labels"])
        ]
        assert len(selected) == 1, f"Service {service['metadata']['name']} selects {len(selected)}"
        for port in service["spec"]["ports"]:
            assert _container_port(selected[0]["spec"]["containers"][0], port["targetPort"])
    for deployment in by_kind(objects, "Deployment").values():
        selector = deployment["spec"]["selector"]["matchLabels"]
        assert _selects(selector, deployment["spec"]["template"]["metadata"]["labels"])
    for pdb in by_kind(objects, "PodDisruptionBudget").values():
        assert any(
            _selects(pdb["spec"]["selector"]["matchLabels"], p["metadata"]["labels"]) for p in pods
        )
    for hpa in by_kind(objects, "HorizontalPodAutoscaler").values():
        assert hpa["spec"]["scaleTargetRef"]["name"] in by_kind(objects, "Deployment")
    accounts = set(by_kind(objects, "ServiceAccount"))
    for pod in pods:
        assert pod["spec"].get("serviceAccountName", "default") in accounts | {"default"}
    for kind, role_kind in (("RoleBinding", "Role"), ("ClusterRoleBinding", "ClusterRole")):
        for binding in by_kind(objects, kind).values():
            assert binding["roleRef"]["name"] in by_kind(objects, role_kind)
            assert {s["name"] for s in binding["subjects"]} <= accounts


@pytest.mark.parametrize("case", CASES)
def test_service_monitors_select_a_service_port(case):
    objects = case_objects(case)
    services = by_kind(objects, "Service").values()
    for monitor in by_kind(objects, "ServiceMonitor").values():
        selector = monitor["spec"]["selector"]["matchLabels"]
        (service,) = [s for s in services if _selects(selector, s["metadata"]["labels"])]
        port_names = {port["name"] for port in service["spec"]["ports"]}
        for endpoint in monitor["spec"]["endpoints"]:
            assert endpoint["port"] in port_names
            assert endpoint["path"] == "/metrics"


def test_service_monitors_cover_every_serving_component_when_enabled():
    monitors = by_kind(case_objects("multi-zone"), "ServiceMonitor")
    components = {m["metadata"]["labels"]["app.kubernetes.io/component"] for m in monitors.values()}
    assert components == {"gateway", "prefill", "decode"}
    assert not by_kind(case_objects("default"), "ServiceMonitor")


def test_pods_that_discover_topology_may_read_nodes():
    objects = case_objects("default")
    (role,) = by_kind(objects, "ClusterRole").values()
    assert role["rules"] == [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get"]}]
    assert not by_kind(case_objects("cpu-dev"), "ClusterRole")  # static region and zone


# ---- tests: NOTES and the dashboard ---------------------------------------------------------


def test_notes_say_how_to_reach_the_gateway():
    notes = _rendered_case("default")["splitserve/templates/NOTES.txt"]
    assert f"port-forward service/{RELEASE}-splitserve-gateway" in notes
    notes = _rendered_case("multi-zone")["splitserve/templates/NOTES.txt"]
    assert "status.loadBalancer.ingress" in notes


def test_grafana_dashboard_ships_in_a_labelled_config_map():
    dashboard = CHART_DIR / "dashboards" / "splitserve.json"
    values = {"grafana": {"dashboard": {"enabled": True}}}
    if not dashboard.exists():
        with pytest.raises(helm.HelmRenderError, match="dashboards/splitserve.json"):
            render(values)
        return
    config_maps = by_kind(objects_of(render(values)), "ConfigMap")
    config_map = config_maps[f"{RELEASE}-splitserve-dashboard"]
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert config_map["data"]["splitserve.json"] == dashboard.read_text().rstrip("\n")
    assert f"{RELEASE}-splitserve-dashboard" not in by_kind(case_objects("default"), "ConfigMap")


# ---- helpers --------------------------------------------------------------------------------


def deployment_containers(objects: list[dict[str, Any]], component: str) -> list[dict[str, Any]]:
    return deployment_of(objects, component)["spec"]["template"]["spec"]["containers"]


def _flag(args: list[str], flag: str) -> str | None:
    """The value after the last `flag` (argparse keeps the last)."""
    values = [args[i + 1] for i, token in enumerate(args[:-1]) if token == flag]
    return values[-1] if values else None


def _container_port(container: dict[str, Any], name_or_number: str | int) -> int | None:
    for port in container.get("ports", []):
        if name_or_number in (port["name"], port["containerPort"]):
            return port["containerPort"]
    return None


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(key) == value for key, value in selector.items())


def test_admission_values_reach_the_gateway_only_when_enabled():
    from splitserve.gateway.__main__ import build_parser  # lazy: the gateway's own parser
    from splitserve.gateway.admission.flags import admission_settings  # lazy: likewise

    def gateway_args(case: str) -> list[str]:
        objects = case_objects(case)
        return command_line(deployment_containers(objects, "gateway")[0], objects)

    assert "--admission" not in gateway_args("default")
    args = gateway_args("autoscaler")
    parsed = build_parser().parse_args(service_module(args)[1])
    settings = admission_settings(parsed)
    assert settings is not None
    assert (settings.slo.ttft_ms, settings.slo.tpot_ms) == (400, 40)
    assert settings.queue_timeout_s == 30 and settings.max_queued_per_tenant == 256
