"""The Kubernetes manifests (deploy/k8s/) against the Kubernetes API's own schema — the models of
the official client, generated from its OpenAPI spec: every field known, typed and required
ones present, at every depth — and against the code: real modules, real settings, probe paths
the services serve on the ports they listen on, Services, budgets and autoscalers that select
real Deployments, autoscaler metrics the adapter rules make from metrics the workers export,
each service on NATS and Redis as its own role (pdserve/shared/grants.py), every container non-root on
a read-only root with limits, NetworkPolicies around every workload. The GPU overlay's patch is
applied and the result checked the same way; the image's user and kernel cache too. (Not run on
a cluster here: no `kubectl`, no cluster, no docker.)"""

from __future__ import annotations

import copy
import importlib.util
import re
from pathlib import Path
from urllib.parse import urlsplit

import kubernetes.client.models as k8s
import pytest
import yaml
from kubernetes.client import ApiClient
from prometheus_client import REGISTRY

import pdserve.shared.metrics  # noqa: F401 - registers the metrics the adapter rules read
from pdserve.shared import grants, probes
from pdserve.shared.config import DecodeSettings, GatewaySettings, IssuerSettings, PrefillSettings, RouterSettings
from pdserve.shared.engine.kernels import cc

DEPLOY = Path(__file__).parents[2] / "deploy"
K8S = DEPLOY / "k8s"
SETTINGS = {"gateway": GatewaySettings, "router": RouterSettings, "prefill": PrefillSettings,
            "decode": DecodeSettings, "issuer": IssuerSettings}
MODELS = {("apps/v1", "Deployment"): "V1Deployment", ("v1", "Service"): "V1Service",
          ("v1", "Secret"): "V1Secret", ("policy/v1", "PodDisruptionBudget"): "V1PodDisruptionBudget",
          ("autoscaling/v2", "HorizontalPodAutoscaler"): "V2HorizontalPodAutoscaler",
          ("networking.k8s.io/v1", "NetworkPolicy"): "V1NetworkPolicy", ("v1", "ConfigMap"): "V1ConfigMap",
          ("batch/v1", "Job"): "V1Job"}
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
SECRETS = {d["metadata"]["name"]: d["stringData"]
           for d in yaml.safe_load_all((K8S / "secret.example.yaml").read_text())}
DOCKERFILE = (DEPLOY / "compose" / "Dockerfile").read_text()


def container(name: str) -> dict:
    return DEPLOYMENTS[name]["spec"]["template"]["spec"]["containers"][0]


def test_every_manifest_is_a_valid_kubernetes_object():
    kustomization = yaml.safe_load((K8S / "base" / "kustomization.yaml").read_text())
    for name in kustomization["resources"]:
        assert (K8S / "base" / name).is_file(), name
    for i, doc in enumerate(BASE):
        validated(doc, f"base[{i}] {doc['kind']} {doc['metadata']['name']}")
    for doc in yaml.safe_load_all((K8S / "secret.example.yaml").read_text()):
        validated(doc, f"secret.example.yaml {doc['metadata']['name']}")
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


def test_the_tls_overlay_gives_every_pod_a_certificate_of_its_own_and_stays_valid():
    """cert-manager's CSI driver makes each pod's certificate when it starts (nothing a person
    edits); pdserve/shared/tls.py reads it where it is mounted; NATS's URL is tls://."""
    overlay = K8S / "overlays" / "tls"
    spec = yaml.safe_load((overlay / "kustomization.yaml").read_text())
    assert spec["resources"] == ["../../base"]
    docs = [*DEPLOYMENTS.values(), *(d for d in BASE if d["kind"] == "Job")]
    for doc in docs:
        for p in spec["patches"]:
            t = p["target"]
            if t["kind"] == doc["kind"] and t.get("name", doc["metadata"]["name"]) == doc["metadata"]["name"]:
                doc = patched(doc, yaml.safe_load((overlay / p["path"]).read_text()))
        name = doc["metadata"]["name"]
        validated(doc, f"tls overlay {name}")
        hardened(doc, f"tls {name}")
        pod, c = doc["spec"]["template"]["spec"], doc["spec"]["template"]["spec"]["containers"][0]
        (volume,) = [v for v in pod["volumes"] if v["name"] == "tls"]
        assert volume["csi"]["driver"] == "csi.cert-manager.io" and "${POD_NAME}" in \
            volume["csi"]["volumeAttributes"]["csi.cert-manager.io/common-name"]
        (mount,) = [m["mountPath"] for m in c["volumeMounts"] if m["name"] == "tls"]
        env = {e["name"]: e for e in c["env"]}
        assert {env[f"PD_TLS_{k}"]["value"] for k in ("CA", "CERT", "KEY")} == \
            {f"{mount}/{f}" for f in ("ca.crt", "tls.crt", "tls.key")}, name
        assert [e["name"] for e in c["env"]].count("PD_NATS_URL") <= 1, name
        if doc["kind"] == "Deployment":
            assert env["PD_NATS_URL"]["value"].startswith("tls://"), name


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_each_deployment_runs_a_real_module_with_real_settings_and_probes(name):
    c = container(name)
    assert importlib.util.find_spec(c["command"][-1]) is not None
    fields = {f"PD_{f}".upper() for f in SETTINGS[name].model_fields}
    env = [e["name"] for e in c["env"]] + list(CONFIG)
    unknown = [k for k in env if k.startswith("PD_") and k not in fields]
    assert not unknown, unknown
    for e in c["env"]:
        ref = e.get("valueFrom", {}).get("secretKeyRef")
        assert ref is None or ref["key"] in SECRETS[ref["name"]], e
    values = {e["name"]: e.get("value") for e in c["env"]} | CONFIG
    port = int(values["PD_METRICS_PORT"])   # every service's probes and metrics, the gateway's apart from its API
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    annotations = DEPLOYMENTS[name]["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true" and int(annotations["prometheus.io/port"]) == port
    served = {p for p in ("/health", "/ready", "/metrics") if p == "/metrics" or probes.answer(p) is not None}
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


def image_user() -> tuple[int, int]:
    uid, gid = re.search(r"^USER (\d+):(\d+)$", DOCKERFILE, re.M).groups()
    return int(uid), int(gid)


def image_env(name: str) -> str:
    return re.search(rf"\b{name}=(\S+)", DOCKERFILE).group(1)


def test_the_image_runs_as_a_fixed_non_root_user_with_a_home_and_a_kernel_cache(monkeypatch):
    uid, gid = image_user()
    assert uid >= 1000 and gid >= 1000
    assert re.search(rf"useradd .*--uid {uid} --gid {gid} --home-dir {image_env('HOME')}", DOCKERFILE)
    cache = image_env("XDG_CACHE_HOME")
    assert cache.startswith(image_env("HOME") + "/") and f"-o {uid} -g {gid}" in DOCKERFILE
    monkeypatch.setenv("XDG_CACHE_HOME", cache)
    assert cc._cache_dir() == Path(cache) / "pdserve"   # where the engine keeps its compiled kernels


def hardened(doc: dict, where: str) -> None:
    """The pod runs as the image's user, each container unprivileged on a read-only root with
    requests and a memory limit; the paths it writes (the kernel cache, /tmp) are emptyDirs."""
    pod = doc["spec"]["template"]["spec"]
    uid, gid = image_user()
    assert pod["securityContext"]["runAsNonRoot"] is True, where
    assert (pod["securityContext"]["runAsUser"], pod["securityContext"]["runAsGroup"]) == (uid, gid), where
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    for c in pod["containers"]:
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True, where
        assert sc["capabilities"]["drop"] == ["ALL"] and not sc["capabilities"].get("add"), where
        assert sc.get("runAsUser", uid) == uid and not sc.get("privileged"), where
        assert {"cpu", "memory"} <= set(c["resources"]["requests"]) and "memory" in c["resources"]["limits"], where
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        for path in (image_env("XDG_CACHE_HOME"), "/tmp"):
            (mount,) = [m for m in mounts if path == m or path.startswith(m + "/")]
            assert "emptyDir" in volumes[mounts[mount]], (where, path)


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_every_container_runs_non_root_on_a_read_only_root_with_limits(name):
    hardened(DEPLOYMENTS[name], name)
    overlay = K8S / "overlays" / "gpu"
    for p in yaml.safe_load((overlay / "kustomization.yaml").read_text())["patches"]:
        if p["target"]["name"] == name:
            hardened(patched(DEPLOYMENTS[name], yaml.safe_load((overlay / p["path"]).read_text())), f"gpu {name}")


def test_the_streams_are_made_by_a_job_as_the_operator_and_no_service_holds_its_url():
    """pdserve/shared/streams.py, once, with the operator's URL from a Secret of its own."""
    (job,) = [d for d in BASE if d["kind"] == "Job"]
    hardened(job, "streams job")
    (c,) = job["spec"]["template"]["spec"]["containers"]
    assert importlib.util.find_spec(c["command"][-1]) is not None and c["command"][-1] == "pdserve.shared.streams"
    env = {e["name"]: e for e in c["env"]}
    assert env["PD_NATS_URL"]["valueFrom"]["secretKeyRef"] == {"name": "pdserve-operator", "key": "nats-url"}
    assert env["PD_KEEP_S"]["value"] == "0"
    assert urlsplit(SECRETS["pdserve-operator"]["nats-url"]).username == grants.OPERATOR
    for name in DEPLOYMENTS:
        refs = {e["valueFrom"]["secretKeyRef"]["name"]: e["valueFrom"]["secretKeyRef"]["key"] for e in
                container(name)["env"] if "secretKeyRef" in e.get("valueFrom", {})}
        # (the issuer: Redis's default user, which makes the pods' users; never the operator's NATS URL)
        assert refs.get("pdserve-operator") == ("redis-url" if name == "issuer" else None), name


@pytest.mark.parametrize("name", sorted(grants.ROLES))
def test_each_pod_is_let_in_by_the_issuer_as_its_own_user(name):
    """A pod holds its role's enrollment token and no user: not in PD_NATS_URL, not in
    PD_REDIS_URL, no id of its own (the issuer names it after its key, pdserve/shared/identity.py)."""
    env = {e["name"]: e for e in container(name)["env"]}
    assert env["PD_ENROLL_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "pdserve-identity", "key": f"enroll-{name}"}
    assert env["PD_REDIS_URL"]["valueFrom"]["secretKeyRef"] == {"name": "pdserve-bus", "key": "redis-url"}
    assert "PD_NATS_URL" not in env and urlsplit(CONFIG["PD_NATS_URL"]).username is None
    assert urlsplit(SECRETS["pdserve-bus"]["redis-url"]).username is None
    assert not {"PD_WORKER_ID", "PD_ROUTER_ID", "PD_GATEWAY_ID"} & set(env)
    issuer = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container("issuer")["env"] if "valueFrom" in e}
    assert issuer[f"PD_ENROLL_{name.upper()}"] == {"name": "pdserve-identity", "key": f"enroll-{name}"}
    # nats-server's environment holds what its authorization block reads, nothing more
    conf = (DEPLOY / "nats" / "authorization.conf").read_text()
    assert set(re.findall(r"\$(PD_\w+)", conf)) == set(SECRETS["pdserve-nats-users"])


def test_the_nats_users_configmap_is_the_rendered_authorization():
    (doc,) = [d for d in BASE if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "pdserve-nats-authorization"]
    assert doc["data"]["authorization.conf"] == (DEPLOY / "nats" / "authorization.conf").read_text()


def selects(selector: dict, labels: dict) -> bool:
    assert set(selector) <= {"matchLabels", "matchExpressions"}, selector
    ok = selector.get("matchLabels", {}).items() <= labels.items()
    for e in selector.get("matchExpressions", []):
        assert e["operator"] == "In", e
        ok = ok and labels.get(e["key"]) in e["values"]
    return ok


def port_range(port: dict, ports: dict[str, int]) -> tuple[int, int]:
    first = ports[port["port"]] if isinstance(port["port"], str) else port["port"]
    return first, port.get("endPort", first)


def test_network_policies_admit_only_the_gateway_from_outside_and_the_workers_to_each_other():
    policies = [d for d in BASE if d["kind"] == "NetworkPolicy"]
    labels = {n: d["spec"]["template"]["metadata"]["labels"] for n, d in DEPLOYMENTS.items()}
    ucx = tuple(int(p) for p in CONFIG["UCX_TCP_PORT_RANGE"].split("-"))
    prometheus = {"namespaceSelector": {}, "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}
    workers = {"prefill", "decode"}
    bus = SECRETS["pdserve-bus"]
    needed = {53, urlsplit(CONFIG["PD_NATS_URL"]).port, urlsplit(bus["redis-url"]).port, 6379,
              urlsplit(CONFIG["OTEL_EXPORTER_OTLP_ENDPOINT"]).port}   # DNS, NATS, Sentinel, Redis, OTLP
    for name in DEPLOYMENTS:
        mine = [p["spec"] for p in policies if selects(p["spec"]["podSelector"], labels[name])]
        assert any("Ingress" in p["policyTypes"] for p in mine), name   # default deny, then what is listed
        assert any("Egress" in p["policyTypes"] for p in mine), name
        ports = {p["name"]: p["containerPort"] for p in container(name)["ports"]}
        served = {(port, port) for port in ports.values()} | ({ucx} if name in workers else set())
        for rule in (r for p in mine if "Ingress" in p["policyTypes"] for r in p.get("ingress", [])):
            opened = {port_range(p, ports) for p in rule["ports"]}
            assert opened <= served, (name, rule)   # only ports it listens on
            if "from" not in rule:                  # from anywhere: the gateway's API only
                assert name == "gateway" and opened == {(ports["http"], ports["http"])}, (name, rule)
            elif opened == {ucx}:                   # KV: from prefill and decode pods only
                assert name in workers and all(
                    set(n for n in DEPLOYMENTS if selects(peer["podSelector"], labels[n])) == workers
                    and "namespaceSelector" not in peer for peer in rule["from"]), rule
            else:                                   # metrics: Prometheus's scrapes
                assert rule["from"] == [prometheus] and opened == {(ports["metrics"],) * 2}, (name, rule)
        egress = [r for p in mine if "Egress" in p["policyTypes"] for r in p.get("egress", [])]
        reached = {port_range(p, ports) for r in egress for p in r["ports"]}
        assert {(p, p) for p in needed} <= reached | ({ucx} if name in workers else set()), name
        assert all("ipBlock" not in peer for r in egress for peer in r.get("to", [])), name
        if name in workers:
            assert ucx in reached
        else:
            assert ucx not in reached and all(port_range(p, ports) != ucx for r in egress for p in r["ports"])
    assert 1 <= ucx[0] <= ucx[1] < 65536

