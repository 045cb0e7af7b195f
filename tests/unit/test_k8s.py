"""The Kubernetes manifests (deploy/k8s/) against the Kubernetes API's own schema — the models of
the official client, generated from its OpenAPI spec: every field known, typed and required
ones present, at every depth — and against the code: real modules, real settings, probe paths
the services serve on the ports they listen on, Services, budgets and autoscalers that select
real Deployments, autoscaler metrics the adapter rules make from metrics the workers export.
The GPU overlay's patch is applied and the result checked the same way. (Not run on a cluster
here: no `kubectl`, no cluster.)"""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import kubernetes.client.models as k8s
import pytest
import yaml
from kubernetes.client import ApiClient
from prometheus_client import REGISTRY

import shared.metrics  # noqa: F401 - registers the metrics the adapter rules read
from services.gateway.api import router as gateway_routes
from shared import probes
from shared.config import DecodeSettings, GatewaySettings, PrefillSettings, RouterSettings

K8S = Path(__file__).parents[2] / "deploy" / "k8s"
SETTINGS = {"gateway": GatewaySettings, "router": RouterSettings, "prefill": PrefillSettings,
            "decode": DecodeSettings}
MODELS = {("apps/v1", "Deployment"): "V1Deployment", ("v1", "Service"): "V1Service",
          ("v1", "Secret"): "V1Secret", ("policy/v1", "PodDisruptionBudget"): "V1PodDisruptionBudget",
          ("autoscaling/v2", "HorizontalPodAutoscaler"): "V2HorizontalPodAutoscaler"}
SCALARS = {"str": str, "int": int, "float": (int, float), "bool": bool}


def strict(data, type_name: str, where: str) -> None:
    """`data` as the API's type `type_name`: no field the API does not know, each of its type."""
    if type_name.startswith("Optional["):
        strict(data, type_name[9:-1], where)
    elif type_name.startswith("List["):
        assert isinstance(data, list), where
        for i, item in enumerate(data):
            strict(item, type_name[5:-1], f"{where}[{i}]")
    elif type_name.startswith("Dict["):
        assert isinstance(data, dict), where
        for key, value in data.items():
            strict(value, type_name[type_name.index(",") + 2:-1], f"{where}.{key}")
    elif type_name == "object":   # int-or-string, quantities, free-form
        assert isinstance(data, (str, int, float, dict, list)), where
    elif type_name in SCALARS:
        assert isinstance(data, SCALARS[type_name]) and not (type_name != "bool" and isinstance(data, bool)), \
            f"{where}: {data!r} is not {type_name}"
    else:
        cls = getattr(k8s, type_name)
        assert isinstance(data, dict), f"{where}: not an object"
        fields = {json_key: attr for attr, json_key in cls.attribute_map.items()}
        unknown = set(data) - set(fields)
        assert not unknown, f"{where}: {type_name} has no field {sorted(unknown)}"
        for key, value in data.items():
            strict(value, cls.openapi_types[fields[key]], f"{where}.{key}")


def validated(doc: dict, where: str) -> None:
    model = MODELS[(doc["apiVersion"], doc["kind"])]
    strict(doc, model, where)
    ApiClient()._ApiClient__deserialize(doc, model)   # the client's own checks: required fields present


def documents(kustomization: Path) -> list[dict]:
    spec = yaml.safe_load(kustomization.read_text())
    return [doc for name in spec.get("resources", []) if (kustomization.parent / name).is_file()
            for doc in yaml.safe_load_all((kustomization.parent / name).read_text())]


def patched(doc: dict, ops: list[dict]) -> dict:
    """A JSON 6902 patch (add / replace) applied to a copy of `doc`."""
    doc = copy.deepcopy(doc)
    for op in ops:
        *parents, last = op["path"].strip("/").split("/")
        node = doc
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        if isinstance(node, list):
            node.insert(len(node) if last == "-" else int(last), op["value"])
        else:
            assert op["op"] == "add" or last in node, op
            node[last] = op["value"]
    return doc


BASE = documents(K8S / "base" / "kustomization.yaml")
DEPLOYMENTS = {d["metadata"]["name"]: d for d in BASE if d["kind"] == "Deployment"}
CONFIG = dict(item.split("=", 1) for item in yaml.safe_load((K8S / "base" / "kustomization.yaml").read_text())
              ["configMapGenerator"][0]["literals"])


def container(name: str) -> dict:
    return DEPLOYMENTS[name]["spec"]["template"]["spec"]["containers"][0]


def test_every_manifest_is_a_valid_kubernetes_object():
    kustomization = yaml.safe_load((K8S / "base" / "kustomization.yaml").read_text())
    for name in kustomization["resources"]:
        assert (K8S / "base" / name).is_file(), name
    for i, doc in enumerate(BASE):
        validated(doc, f"base[{i}] {doc['kind']} {doc['metadata']['name']}")
    validated(yaml.safe_load((K8S / "secret.example.yaml").read_text()), "secret.example.yaml")
    assert set(DEPLOYMENTS) == set(SETTINGS)


def test_the_gpu_overlay_gives_each_worker_a_gpu_and_stays_valid():
    overlay = yaml.safe_load((K8S / "overlays" / "gpu" / "kustomization.yaml").read_text())
    assert overlay["resources"] == ["../../base"]
    targets = {p["target"]["name"]: p["path"] for p in overlay["patches"]}
    assert set(targets) == {"prefill", "decode"}
    for name, path in targets.items():
        doc = patched(DEPLOYMENTS[name], yaml.safe_load((K8S / "overlays" / "gpu" / path).read_text()))
        validated(doc, f"gpu overlay {name}")
        c = doc["spec"]["template"]["spec"]["containers"][0]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
        assert {"name": "PD_DEVICE", "value": "cuda"} in c["env"]


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_each_deployment_runs_a_real_module_with_real_settings_and_probes(name):
    c = container(name)
    assert importlib.util.find_spec(c["command"][-1]) is not None
    fields = {f"PD_{f}".upper() for f in SETTINGS[name].model_fields}
    env = [e["name"] for e in c["env"]] + list(CONFIG)
    unknown = [k for k in env if k.startswith("PD_") and k not in fields]
    assert not unknown, unknown
    secret = yaml.safe_load((K8S / "secret.example.yaml").read_text())["stringData"]
    for e in c["env"]:
        ref = e.get("valueFrom", {}).get("secretKeyRef")
        assert ref is None or (ref["name"] == "pdserve-bus" and ref["key"] in secret), e
    values = {e["name"]: e.get("value") for e in c["env"]} | CONFIG
    port = int(values["PD_GATEWAY_PORT"] if name == "gateway" else values["PD_METRICS_PORT"])
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    annotations = DEPLOYMENTS[name]["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true" and int(annotations["prometheus.io/port"]) == port
    served = {r.path for r in gateway_routes.routes} if name == "gateway" else \
        {p for p in ("/health", "/ready", "/metrics") if p == "/metrics" or probes.answer(p) is not None}
    assert annotations["prometheus.io/path"] in served
    for kind in ("readinessProbe", "livenessProbe", "startupProbe"):
        if kind in c:
            assert c[kind]["httpGet"]["path"] in served, (kind, c[kind])
            assert ports[c[kind]["httpGet"]["port"]] == port, (kind, ports)
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready" and c["livenessProbe"]["httpGet"]["path"] == "/health"


def test_drain_graces_cover_what_each_service_finishes_before_it_exits():
    grace = {n: d["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] for n, d in DEPLOYMENTS.items()}
    assert grace["prefill"] > PrefillSettings().kv_ack_timeout_s        # its handoffs' KV is kept that long
    drain_s = next(int(e["value"]) for e in container("gateway")["env"] if e["name"] == "PD_DRAIN_S")
    assert grace["gateway"] > drain_s + 5 and drain_s > GatewaySettings().token_timeout_s  # preStop 5 s, then drain
    assert grace["decode"] >= grace["gateway"]                           # it finishes the streams the gateways relay
    preStop = container("gateway")["lifecycle"]["preStop"]["exec"]["command"]
    assert preStop[0] == "sleep"                                         # out of the endpoints before SIGTERM


def test_services_budgets_and_autoscalers_select_real_deployments_on_exported_metrics():
    labels = {n: d["spec"]["template"]["metadata"]["labels"] for n, d in DEPLOYMENTS.items()}
    selected = lambda sel: [n for n, lab in labels.items() if sel.items() <= lab.items()]  # noqa: E731
    for doc in BASE:
        if doc["kind"] == "Service":
            (target,) = selected(doc["spec"]["selector"])
            names = {p["name"] for p in container(target)["ports"]}
            assert all(p["targetPort"] in names for p in doc["spec"]["ports"]), doc
        elif doc["kind"] == "PodDisruptionBudget":
            assert len(selected(doc["spec"]["selector"]["matchLabels"])) == 1, doc
    budgets = {d["metadata"]["name"] for d in BASE if d["kind"] == "PodDisruptionBudget"}
    assert budgets == set(DEPLOYMENTS)
    rules = yaml.safe_load((K8S / "prometheus-adapter-rules.yaml").read_text())
    made = {r["name"]["as"]: r["seriesQuery"].split("{")[0] for r in rules}
    exported = {m.name for m in REGISTRY.collect()}
    assert set(made.values()) <= exported, set(made.values()) - exported
    scaled = {}
    for doc in BASE:
        if doc["kind"] == "HorizontalPodAutoscaler":
            ref = doc["spec"]["scaleTargetRef"]
            assert ref["kind"] == "Deployment" and ref["name"] in DEPLOYMENTS
            scaled[ref["name"]] = [m["pods"]["metric"]["name"] for m in doc["spec"]["metrics"]]
    assert set(scaled) == {"prefill", "decode"}
    assert all("replicas" not in DEPLOYMENTS[name]["spec"] for name in scaled)   # the autoscaler's to set
    assert all(name in made for names in scaled.values() for name in names), scaled
    assert scaled["prefill"] == ["pd_queued_prompt_tokens"]
