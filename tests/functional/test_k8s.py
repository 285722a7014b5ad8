"""The Kubernetes manifests, offline: rendered the way kustomize does (the subset of it k8s/ uses; any
other kustomization field fails the test), validated against the Kubernetes schemas
(kubernetes-validate, strict), KEDA's objects against their required fields, and cross-checked:
selectors, references, env names the code reads, probes, ports, drain time, security, the queue
KEDA watches (on the real Redis broker) and the query it runs (on a real Postgres database)."""

import copy
import json
import re
import uuid
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import redis
import requests
import yaml
from flask import Flask
from kubernetes_validate.utils import latest_version
from sqlalchemy import create_engine, text

from common.broker import BACKGROUND, dispatch, make_celery
from common.registry import queue_name
from common.settings import Settings
from tests.harness import free_port
from tests.unit.test_metrics import fake_ctx

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
KUBERNETES = latest_version()  # the newest schemas kubernetes-validate bundles
SETTINGS_ENV = {f"LMSP_{name.upper()}" for name in Settings.model_fields}
WORKLOADS = ("Deployment", "StatefulSet", "Job")


# -- a kustomize build of the fields k8s/ uses --------------------------------------------------------
def _docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _pointer(doc, path: str):
    *parents, last = [int(p) if p.isdigit() else p.replace("~1", "/").replace("~0", "~")
                      for p in path.lstrip("/").split("/")]
    for part in parents:
        doc = doc[part]
    return doc, last


def _patch(doc: dict, ops: list[dict]) -> None:
    for op in ops:
        parent, key = _pointer(doc, op["path"])
        assert op["op"] in ("replace", "add"), op
        if op["op"] == "replace":
            parent[key]  # noqa: B018 - replace needs the path to exist (KeyError / IndexError otherwise)
        parent[key] = op["value"]


def _pod_spec(doc: dict) -> dict | None:
    return doc["spec"]["template"]["spec"] if doc["kind"] in WORKLOADS else None


def _rename_refs(docs: list[dict], kind: str, old: str, new: str) -> None:
    for doc in docs:
        pod = _pod_spec(doc)
        if kind == "Service" and doc["kind"] == "StatefulSet" and doc["spec"].get("serviceName") == old:
            doc["spec"]["serviceName"] = new
        if kind in ("ConfigMap", "Secret") and pod:
            for c in pod["containers"]:
                for ref in c.get("envFrom", []):
                    key = "configMapRef" if kind == "ConfigMap" else "secretRef"
                    if ref.get(key, {}).get("name") == old:
                        ref[key]["name"] = new
            for volume in pod.get("volumes", []):
                if kind == "ConfigMap" and volume.get("configMap", {}).get("name") == old:
                    volume["configMap"]["name"] = new
        if doc["kind"] == "HorizontalPodAutoscaler" and doc["spec"]["scaleTargetRef"]["kind"] == kind \
                and doc["spec"]["scaleTargetRef"]["name"] == old:
            doc["spec"]["scaleTargetRef"]["name"] = new


def _add_labels(doc: dict, pairs: dict, selectors: bool, templates: bool) -> None:
    doc["metadata"].setdefault("labels", {}).update(pairs)
    spec = doc.get("spec", {})
    if selectors:
        if doc["kind"] == "Service":
            spec.setdefault("selector", {}).update(pairs)
        elif doc["kind"] in ("Deployment", "StatefulSet", "PodDisruptionBudget"):
            spec["selector"].setdefault("matchLabels", {}).update(pairs)
    if (selectors or templates) and doc["kind"] in WORKLOADS:
        spec["template"]["metadata"].setdefault("labels", {}).update(pairs)
    if (selectors or templates) and doc["kind"] == "StatefulSet":
        for claim in spec.get("volumeClaimTemplates", []):
            claim["metadata"].setdefault("labels", {}).update(pairs)


def build(folder: Path) -> list[dict]:
    k = yaml.safe_load((folder / "kustomization.yaml").read_text())
    known = {"apiVersion", "kind", "resources", "nameSuffix", "labels", "patches", "configMapGenerator", "images"}
    assert set(k) <= known, f"{folder}: kustomization fields this test does not render: {set(k) - known}"
    docs = []
    for resource in k.get("resources", []):
        path = folder / resource
        docs += build(path) if path.is_dir() else _docs(path)
    for gen in k.get("configMapGenerator", []):
        assert set(gen) <= {"name", "namespace", "files", "options"} and gen["options"]["disableNameSuffixHash"]
        docs.append({"apiVersion": "v1", "kind": "ConfigMap",
                     "metadata": {"name": gen["name"], "namespace": gen["namespace"],
                                  "labels": dict(gen["options"].get("labels", {}))},
                     "data": {Path(f).name: (folder / f).read_text() for f in gen["files"]}})
    for patch in k.get("patches", []):
        targets = [d for d in docs if all(d.get(key) == value if key != "name" else d["metadata"]["name"] == value
                                          for key, value in patch["target"].items())]
        assert len(targets) == 1, f"{folder}: patch target {patch['target']} matches {len(targets)} objects"
        _patch(targets[0], yaml.safe_load(patch["patch"]))
    if suffix := k.get("nameSuffix"):
        for doc in docs:
            if doc["kind"] != "Namespace":
                old = doc["metadata"]["name"]
                doc["metadata"]["name"] = old + suffix
                _rename_refs(docs, doc["kind"], old, old + suffix)
    for entry in k.get("labels", []):
        for doc in docs:
            _add_labels(doc, entry["pairs"], entry.get("includeSelectors", False), entry.get("includeTemplates", False))
    for image in k.get("images", []):
        for doc in docs:
            if pod := _pod_spec(doc):
                for c in pod["containers"]:
                    if c["image"].split(":")[0] == image["name"]:
                        c["image"] = f"{image.get('newName', image['name'])}:{image['newTag']}"
    return docs


@pytest.fixture(scope="module")
def rendered() -> list[dict]:
    return build(K8S)


def of(docs, kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def named(docs, kind: str, name: str) -> dict:
    found = [d for d in of(docs, kind) if d["metadata"]["name"] == name]
    assert len(found) == 1, f"no {kind} {name}"
    return found[0]


def matches(selector: dict, labels: dict) -> bool:
    ok = all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())
    for expr in selector.get("matchExpressions", []):
        assert expr["operator"] == "In"
        ok = ok and labels.get(expr["key"]) in expr["values"]
    return ok


def pods(docs) -> list[tuple[dict, dict]]:
    """(workload, its pod template) for every workload."""
    return [(d, d["spec"]["template"]) for d in docs if d["kind"] in WORKLOADS]


def config(docs) -> dict:
    return named(docs, "ConfigMap", "lmsp-env")["data"]


# -- schemas ------------------------------------------------------------------------------------------
KEDA_SCHEMAS = {
    "ScaledObject": {
        "type": "object", "required": ["spec"],
        "properties": {"spec": {
            "type": "object", "required": ["scaleTargetRef", "triggers"], "additionalProperties": False,
            "properties": {
                "scaleTargetRef": {"type": "object", "required": ["name"],
                                   "properties": {"apiVersion": {"type": "string"}, "kind": {"type": "string"},
                                                  "name": {"type": "string"}}, "additionalProperties": False},
                "minReplicaCount": {"type": "integer", "minimum": 0},
                "maxReplicaCount": {"type": "integer", "minimum": 1},
                "pollingInterval": {"type": "integer"}, "cooldownPeriod": {"type": "integer"},
                "advanced": {"type": "object"},
                "triggers": {"type": "array", "minItems": 1, "items": {
                    "type": "object", "required": ["type", "metadata"], "additionalProperties": False,
                    "properties": {"type": {"enum": ["redis", "postgresql", "prometheus"]}, "name": {"type": "string"},
                                   "metadata": {"type": "object", "additionalProperties": {"type": "string"}},
                                   "authenticationRef": {"type": "object", "required": ["name"]}}}}}}}},
    "TriggerAuthentication": {
        "type": "object", "required": ["spec"],
        "properties": {"spec": {"type": "object", "required": ["secretTargetRef"], "properties": {
            "secretTargetRef": {"type": "array", "items": {
                "type": "object", "required": ["parameter", "name", "key"], "additionalProperties": False,
                "properties": {"parameter": {"type": "string"}, "name": {"type": "string"},
                               "key": {"type": "string"}}}}}}}},
}


def every_manifest() -> list[tuple[str, dict]]:
    """Each document under k8s/, rendered where a kustomization includes it, as it is elsewhere."""
    out = [(f"k8s/ {d['kind']}/{d['metadata']['name']}", d) for d in build(K8S)]
    out += [(f"k8s/datastores {d['kind']}/{d['metadata']['name']}", d) for d in build(K8S / "datastores")]
    return out


def test_every_manifest_is_valid_against_the_kubernetes_schemas():
    seen = set()
    for where, doc in every_manifest():
        seen.add(doc["kind"])
        if doc["apiVersion"].startswith("keda.sh/"):
            jsonschema.validate(doc, KEDA_SCHEMAS[doc["kind"]])
        else:
            try:
                kubernetes_validate.validate(doc, KUBERNETES, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{where}: {exc.message} at {'/'.join(map(str, exc.path))}")
    assert {"Deployment", "StatefulSet", "Job", "HorizontalPodAutoscaler", "PodDisruptionBudget", "NetworkPolicy",
            "ScaledObject", "TriggerAuthentication"} <= seen
    yaml_files = {p.relative_to(K8S) for p in K8S.rglob("*.yaml") if p.name != "kustomization.yaml"}
    included = set()
    for folder in [K8S, *[p.parent for p in K8S.rglob("kustomization.yaml")]]:
        k = yaml.safe_load((folder / "kustomization.yaml").read_text())
        included |= {(folder / r).relative_to(K8S) for r in k.get("resources", []) if (folder / r).is_file()}
    assert yaml_files == included, "a manifest no kustomization applies"


def test_invalid_manifests_are_caught(tmp_path):
    api = copy.deepcopy(named(build(K8S), "Deployment", "lmsp-api"))
    api["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["prot"] = 1
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(api, KUBERNETES, strict=True)
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "resources": [str(K8S / "worker")], "patches": [{"target": {"kind": "Deployment"}, "patch": "[]"}]}))
    with pytest.raises(AssertionError, match="patch target"):
        build(tmp_path)


# -- cross references --------------------------------------------------------------------------------------
def test_selectors_and_references_resolve(rendered):
    templates = pods(rendered)
    for kind in ("Service", "PodDisruptionBudget", "NetworkPolicy"):
        for doc in of(rendered, kind):
            selector = {"matchLabels": doc["spec"]["selector"]} if kind == "Service" else \
                doc["spec"]["podSelector" if kind == "NetworkPolicy" else "selector"]
            hits = [w for w, t in templates if matches(selector, t["metadata"]["labels"])]
            assert hits, f"{kind} {doc['metadata']['name']} selects no pod"
            if kind == "PodDisruptionBudget":
                assert len(hits) == 1
    for workload, template in templates:
        if workload["kind"] != "Job":
            assert matches(workload["spec"]["selector"], template["metadata"]["labels"])
            others = [w for w, t in templates if w is not workload and matches(workload["spec"]["selector"],
                                                                               t["metadata"]["labels"])]
            assert not others, f"{workload['metadata']['name']} also selects {others[0]['metadata']['name']}"
            assert [p for p in of(rendered, "PodDisruptionBudget")
                    if matches(p["spec"]["selector"], template["metadata"]["labels"])], "no PodDisruptionBudget"
        if workload["kind"] == "StatefulSet":
            service = named(rendered, "Service", workload["spec"]["serviceName"])
            assert service["spec"]["clusterIP"] == "None"
            assert matches({"matchLabels": service["spec"]["selector"]}, template["metadata"]["labels"])
        spec = template["spec"]
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        claims = {c["metadata"]["name"] for c in workload["spec"].get("volumeClaimTemplates", [])}
        for c in spec["containers"]:
            for mount in c.get("volumeMounts", []):
                assert mount["name"] in volumes or mount["name"] in claims
            for ref in c.get("envFrom", []):
                kind, name = ("ConfigMap", ref["configMapRef"]["name"]) if "configMapRef" in ref \
                    else ("Secret", ref["secretRef"]["name"])
                named(rendered, kind, name)
        for volume in volumes.values():
            if "configMap" in volume:
                named(rendered, "ConfigMap", volume["configMap"]["name"])
    hpa = named(rendered, "HorizontalPodAutoscaler", "lmsp-api")
    named(rendered, hpa["spec"]["scaleTargetRef"]["kind"], hpa["spec"]["scaleTargetRef"]["name"])


def env_names(rendered, container: dict) -> set[str]:
    names = {e["name"] for e in container.get("env", [])}
    for ref in container.get("envFrom", []):
        if "configMapRef" in ref:
            names |= set(named(rendered, "ConfigMap", ref["configMapRef"]["name"])["data"])
        else:
            secret = named(rendered, "Secret", ref["secretRef"]["name"])
            names |= set(secret.get("stringData", {})) | set(secret.get("data", {}))
    return names


def test_every_lmsp_variable_is_one_the_code_reads(rendered):
    for workload, template in pods(rendered):
        for c in template["spec"]["containers"]:
            unknown = {n for n in env_names(rendered, c) if n.startswith("LMSP_")} - SETTINGS_ENV
            assert not unknown, f"{workload['metadata']['name']}: {unknown} are read by nothing"


def test_models_each_have_workers_with_their_queue_and_probes(rendered):
    registry = yaml.safe_load(named(rendered, "ConfigMap", "lmsp-models")["data"]["models.yaml"])["models"]
    models = {m["id"] for m in registry}
    env = config(rendered)
    served = set()
    for sts in of(rendered, "StatefulSet"):
        container = sts["spec"]["template"]["spec"]["containers"][0]
        argv = container["command"]
        assert argv[:2] == ["lmsp", "worker"]
        model = argv[argv.index("--model") + 1]
        assert model in models and model not in served
        served.add(model)
        assert {"name": "LMSP_WORKER_ID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}} \
            in container["env"]   # the stable pod name is the worker id
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports["metrics"] == int(env["LMSP_WORKER_METRICS_PORT"])
        assert env["LMSP_WORKER_METRICS_HOST"] == "0.0.0.0"
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["httpGet"]["port"] in ports
        assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
        startup = container["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 1200   # minutes of engine load
        grace = sts["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert grace >= float(env["LMSP_DRAIN_SECONDS"]) + 30, "the kubelet would kill a draining worker"

        scaled = [s for s in of(rendered, "ScaledObject") if s["spec"]["scaleTargetRef"]["name"] == sts["metadata"]["name"]]
        assert len(scaled) == 1 and scaled[0]["spec"]["scaleTargetRef"]["kind"] == "StatefulSet"
        triggers = {t["type"]: t for t in scaled[0]["spec"]["triggers"]}
        assert triggers["redis"]["metadata"]["listName"] == f"{queue_name(model)}:{BACKGROUND}"
        auth = named(rendered, "TriggerAuthentication", triggers["redis"]["authenticationRef"]["name"])
        for ref in auth["spec"]["secretTargetRef"]:
            assert ref["key"] in named(rendered, "Secret", ref["name"])["stringData"]
        assert f"model = '{model}'" in triggers["postgresql"]["metadata"]["query"]
        assert triggers["postgresql"]["metadata"]["connectionFromEnv"] in env_names(rendered, container)
    assert served == models, "a registered model with no worker StatefulSet"


def test_probes_name_routes_that_answer(rendered):
    from api.views import health
    from worker import metrics

    app = Flask(__name__)
    app.register_blueprint(health.bp)
    api_routes = {rule.rule for rule in app.url_map.iter_rules()}
    server = metrics.start_metrics_server(fake_ctx(free_port(), [True]))
    try:
        for workload, template in pods(rendered):
            for c in template["spec"]["containers"]:
                for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                    if probe not in c:
                        continue
                    path = c[probe]["httpGet"]["path"]
                    if workload["kind"] == "StatefulSet":
                        url = "http://{}:{}".format(*server.server_address[:2]) + path
                        assert requests.get(url, timeout=5).status_code == 200, path
                    else:
                        assert path in api_routes, path
    finally:
        server.shutdown()
        server.server_close()



def test_pods_run_non_root_read_only_with_pinned_images(rendered):
    for workload, template in pods(rendered):
        spec = template["spec"]
        assert spec["securityContext"]["runAsNonRoot"] and spec["securityContext"]["runAsUser"] != 0
        for c in spec["containers"]:
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
            assert sc["capabilities"]["drop"] == ["ALL"]
            assert re.fullmatch(r"[\w./-]+:\d[\w.-]*", c["image"]) and not c["image"].endswith(":latest")
            if workload["kind"] != "Job":   # writable: LMSP_HOME and /tmp, nothing else
                assert "readinessProbe" in c and "livenessProbe" in c
                mounts = {m["mountPath"] for m in c["volumeMounts"]}
                assert {"/tmp", config(rendered)["LMSP_HOME"]} <= mounts


def test_only_the_api_workers_and_migration_reach_postgres_and_redis(rendered):
    secret = named(rendered, "Secret", "lmsp-secrets")["stringData"]
    store_ports = {int(re.search(r":(\d+)/", secret[k]).group(1)) for k in ("LMSP_DATABASE_URL", "LMSP_REDIS_URL")}
    policies = of(rendered, "NetworkPolicy")
    deny = named(rendered, "NetworkPolicy", "lmsp-default-deny")
    assert deny["spec"]["podSelector"] == {} and set(deny["spec"]["policyTypes"]) == {"Ingress", "Egress"}
    assert {p["port"] for rule in deny["spec"]["egress"] for p in rule["ports"]} == {53}
    reaching = set()
    for policy in policies:
        for rule in policy["spec"].get("egress", []):
            if {p["port"] for p in rule["ports"]} & store_ports:
                reaching.add(policy["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/name"])
    assert reaching == {"lmsp-api", "lmsp-worker", "lmsp-migrate"}
    (datastores,) = build(K8S / "datastores")
    allowed = datastores["spec"]["ingress"][0]
    assert {p["port"] for p in allowed["ports"]} == store_ports
    names = {t["metadata"]["labels"]["app.kubernetes.io/name"] for _, t in pods(rendered)}
    from_lmsp = allowed["from"][0]["podSelector"]["matchExpressions"][0]["values"]
    assert set(from_lmsp) == reaching and reaching <= names
    for workload, template in pods(rendered):   # each pod's container ports are ones its policy admits
        labels = template["metadata"]["labels"]
        own = [p for p in policies if p["spec"]["podSelector"] and matches(p["spec"]["podSelector"], labels)]
        assert len(own) == 1
        admitted = {p["port"] for rule in own[0]["spec"].get("ingress", []) for p in rule["ports"]}
        ports = {p["containerPort"] for c in template["spec"]["containers"] for p in c.get("ports", [])}
        assert ports == admitted, workload["metadata"]["name"]


# -- what KEDA reads, on the real services -----------------------------------------------------------------
def test_keda_list_is_where_the_broker_puts_a_models_tasks():
    from tests.harness import REDIS_URL

    model = f"keda:{uuid.uuid4().hex[:8]}"
    settings = Settings(broker_url=REDIS_URL, home=Path("/nonexistent"))
    key = f"{queue_name(model)}:{BACKGROUND}"
    client = redis.Redis.from_url(REDIS_URL)
    try:
        dispatch(make_celery(settings), queue_name(model), {"task_id": "task_keda"}, BACKGROUND)
        assert client.llen(key) == 1
    finally:
        client.delete(key, queue_name(model))


def test_keda_query_counts_a_models_claimed_tasks(pg_url, rendered):
    from common.db import session_factory
    from tests import factories

    scaled = of(rendered, "ScaledObject")[0]
    query = next(t for t in scaled["spec"]["triggers"] if t["type"] == "postgresql")["metadata"]["query"]
    model = re.search(r"model = '([^']+)'", query).group(1)
    engine = create_engine(pg_url)
    with engine.connect() as conn:
        before = conn.execute(text(query)).scalar_one()
    with session_factory(engine)() as session:
        ids = [factories.task(session, status, model=model).id for status in ("running", "loading", "queued", "failed")]
        factories.task(session, "running", model=model + "-other")
        session.commit()
    with engine.connect() as conn:
        assert conn.execute(text(query)).scalar_one() == before + 2
        conn.execute(text("DELETE FROM tasks WHERE id = ANY(:ids)"), {"ids": ids})
        conn.commit()
    engine.dispose()


# -- the Grafana dashboard ----------------------------------------------------------------------------------
def known_metrics() -> dict[str, set[str]]:
    """Every sample name either side exposes, with its labels."""
    from prometheus_client import REGISTRY

    from api.views.metrics import FAMILIES
    from worker import metrics  # noqa: F401 - registers the worker's metrics

    out = {name: set(labels) for name, (_, labels) in FAMILIES.items()}
    for collector in list(REGISTRY._collector_to_names):
        for family in collector.collect():
            if family.name.startswith("lmsp_"):
                suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}.get(family.type, [""])
                labels = set(getattr(collector, "_labelnames", ()))
                for suffix in suffixes:
                    out[family.name + suffix] = labels | ({"le"} if suffix == "_bucket" else set())
    return out


def test_dashboard_queries_only_metrics_and_labels_that_exist():
    dashboard = json.loads((K8S / "grafana-dashboard.json").read_text())
    exposed = known_metrics()
    scrape_labels = {"instance", "job", "pod", "namespace"}
    used = set()
    for panel in dashboard["panels"]:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            expr = target["expr"]
            names = set(re.findall(r"\blmsp_\w+", expr))
            assert names, f"{panel['title']}: no lmsp metric"
            for name in names:
                assert name in exposed, f"{panel['title']}: {name} is exposed by nothing"
            labels = set().union(*(exposed[n] for n in names)) | scrape_labels
            for group in re.findall(r"by \(([^)]*)\)", expr):
                for label in (g.strip() for g in group.split(",")):
                    assert label in labels, f"{panel['title']}: no label {label} on {names}"
            for label in re.findall(r"(\w+)=~?\"", expr):
                assert label in labels, f"{panel['title']}: no label {label}"
            used |= names
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            assert set(re.findall(r"\blmsp_\w+", variable["definition"])) <= set(exposed)
    families = {re.sub(r"_(total|bucket|sum|count)$", "", n) for n in exposed}
    assert families == {re.sub(r"_(total|bucket|sum|count)$", "", n) for n in used}, "a metric with no panel"
