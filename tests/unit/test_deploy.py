"""The images and the compose deployments, checked without a container engine (none runs here): the
Containerfile parses and passes our lint rules (base pinned by digest, dependencies installed before the
source is copied, an init process), its install steps are the Makefile's; the compose files validate
against the compose specification's JSON schema (tests/schemas), and their services, volumes, GPUs,
addresses and settings refer to things that exist."""

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml
from dockerfile_parse import DockerfileParser

from common.registry import Registry
from common.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
TARGETS = {"cpu": "cpu", "gpu": "gpu"}  # image target: the pyproject extra it installs
SETTINGS_ENV = {f"LMSP_{name.upper()}" for name in Settings.model_fields}


# -- Containerfile --------------------------------------------------------------------------------------
def stages() -> dict[str, list[dict]]:
    """Stage name -> its instructions (the FROM first)."""
    parsed = DockerfileParser(fileobj=(ROOT / "Containerfile").open("rb"))
    out, current = {}, None
    for instr in parsed.structure:
        if instr["instruction"] == "FROM":
            current = instr["value"].split()[-1]
            out[current] = []
        if current and instr["instruction"] != "COMMENT":
            out[current].append(instr)
    return out


def global_args() -> dict[str, str]:
    parsed = DockerfileParser(fileobj=(ROOT / "Containerfile").open("rb"))
    args = {}
    for instr in parsed.structure:
        if instr["instruction"] == "FROM":
            break
        if instr["instruction"] == "ARG" and "=" in instr["value"]:
            key, value = instr["value"].split("=", 1)
            args[key] = value
    return args


def chain(name: str, all_stages: dict) -> list[str]:
    """The stage and the stages it is built FROM, nearest first."""
    out = [name]
    while (parent := all_stages[out[-1]][0]["value"].split()[0]) in all_stages:
        out.append(parent)
    return out


def env_of(target: str, all_stages: dict) -> dict[str, str]:
    env = {}
    for stage in reversed(chain(target, all_stages)):
        for instr in all_stages[stage]:
            if instr["instruction"] == "ENV":
                env.update(dict(part.split("=", 1) for part in shlex.split(instr["value"])))
    return env


def test_containerfile_lint_rules():
    all_stages, args = stages(), global_args()
    assert set(TARGETS) <= set(all_stages)
    for name, body in all_stages.items():
        base = body[0]["value"].split()[0]
        base = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], base)
        if base not in all_stages:   # an outside image: pinned to a version, never latest
            assert re.fullmatch(r"[\w./-]+:\d[\w.-]*@sha256:[0-9a-f]{64}", base), f"{name}: not pinned by digest: {base}"
        for instr in body:
            value = instr["value"]
            assert instr["instruction"] not in ("ADD", "MAINTAINER"), f"{name}: use COPY / LABEL"
            if instr["instruction"] == "COPY" and "--from=" in value:
                assert re.search(r"--from=(\S+)", value).group(1) in all_stages
            if instr["instruction"] == "RUN":
                assert "sudo " not in value and "curl " not in value and "wget " not in value
                assert "pip install" not in value, "the project installs through the Makefile only"
                if "apt-get install" in value:
                    assert "apt-get update" in value and "--no-install-recommends" in value \
                        and "rm -rf /var/lib/apt/lists/*" in value
    for target in TARGETS:
        instrs = [i for stage in reversed(chain(target, all_stages)) for i in all_stages[stage]]
        users = [i["value"] for i in instrs if i["instruction"] == "USER"]
        assert users and users[-1].split(":")[0] not in ("root", "0"), f"{target} runs as root"
        volumes = " ".join(i["value"] for i in instrs if i["instruction"] == "VOLUME")
        env = env_of(target, all_stages)
        assert env["LMSP_HOME"] in volumes   # the model cache is a volume
        assert env["PATH"].startswith("/opt/lmsp/bin:")
        entry = [json.loads(i["value"]) for i in instrs if i["instruction"] == "ENTRYPOINT"]
        assert entry and entry[-1][0].endswith("/tini"), "PID 1 must be an init that passes SIGTERM on"
        runs = " ".join(i["value"] for i in instrs if i["instruction"] == "RUN")
        assert re.search(r"apt-get install [^&]*\btini\b", runs)


def make_install_of(target: str) -> list[str]:
    """The `make install ...` arguments the target's build stage runs, after `make deps` with the same
    extras and before it, only pyproject.toml and the Makefile copied (a source edit reuses the deps layer)."""
    all_stages = stages()
    copy = next(i["value"] for i in all_stages[target] if i["instruction"] == "COPY" and "--from=" in i["value"])
    build_stage = re.search(r"--from=(\S+)", copy).group(1)
    steps = [i for stage in reversed(chain(build_stage, all_stages)) for i in all_stages[stage]
             if i["instruction"] in ("RUN", "COPY")]
    makes = [(n, shlex.split(i["value"])) for n, i in enumerate(steps) if i["value"].startswith("make ")]
    assert [argv[:2] for _, argv in makes] == [["make", "deps"], ["make", "install"]], steps
    (deps_at, deps), (install_at, install) = makes
    everything = [n for n, i in enumerate(steps) if i["instruction"] == "COPY" and i["value"].split()[0] == "."]
    assert len(everything) == 1 and deps_at < everything[0] < install_at, "the source is copied before the deps"
    early = [i["value"].split()[:-1] for i in steps[:deps_at] if i["instruction"] == "COPY"]
    assert early == [["pyproject.toml", "Makefile"]]
    assert [a for a in deps if a.startswith("EXTRAS=")] == [a for a in install if a.startswith("EXTRAS=")]
    return install[2:]


@pytest.mark.parametrize("target", TARGETS)
def test_image_installs_with_the_makefiles_own_install_target(target, tmp_path):
    args = dict(a.split("=", 1) for a in make_install_of(target))
    env = env_of(target, stages())
    assert env["PATH"].split(":")[0] == args["VENV"] + "/bin"   # `lmsp` on PATH is the venv's
    # What `make install` runs with the image's arguments (make -n prints it), for a venv not yet made.
    dry = subprocess.run(["make", "-n", "install", *[f"{k}={v}" for k, v in {**args, "VENV": str(tmp_path / "v")}
                                                     .items()]], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout
    pip = [line for line in dry.splitlines() if re.search(r"/pip install .*\"\.\[", line)]
    assert len(pip) == 1 and f'".[{TARGETS[target]}]"' in pip[0] and " -e " not in pip[0], dry
    # The CPU-only clean-up of CUDA torchvision is keyed on the same extra.
    assert f'if [ "{TARGETS[target]}" = cpu ]; then' in dry and "uninstall --quiet -y torchvision" in dry
    assert f"{tmp_path / 'v'}/.installed" in dry
    # A workstation's `make install` is the same recipe: editable, with the dev tools.
    local = subprocess.run(["make", "-n", "install", f"VENV={tmp_path / 'w'}", f"EXTRA={TARGETS[target]}"],
                           cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert f'-e ".[{TARGETS[target]},dev]"' in local


def test_build_context_leaves_out_the_venv_and_git():
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".venv", ".git"} <= set(ignored)


# -- compose files ---------------------------------------------------------------------------------------
COMPOSE_FILES = ("compose.yaml", "compose.head.yaml", "compose.gpu.yaml")


def dotenv(path: Path) -> dict[str, str]:
    pairs = (line.split("=", 1) for line in path.read_text().splitlines() if line and not line.startswith("#"))
    return {k: v for k, v in pairs}


ENV = dotenv(ROOT / ".env.example")


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's ${VAR:-default} / ${VAR:?message} / ${VAR} (nested defaults too) with ``env``; a required
    variable .env.example leaves unset fails."""
    def one(m):
        name, rule = m.group(1), m.group(2) or ""
        if env.get(name):
            return env[name]
        assert not rule.startswith(":?"), f"{name} is required and .env.example does not set it"
        return rule[2:] if rule.startswith(":-") else ""
    while (new := re.sub(r"\$\{(\w+)((?::-|:\?)[^${}]*)?\}", one, text)) != text:
        text = new
    return text


def load(name: str, env: dict[str, str] = ENV) -> dict:
    model = yaml.safe_load(interpolate((ROOT / name).read_text(), env))
    for included in model.pop("include", []):  # compose's include: the files' services and volumes, merged
        part = load(included, env)
        for key in ("services", "volumes"):
            clash = set(model.get(key) or {}) & set(part.get(key) or {})
            assert not clash, f"{name}: {included} defines {key} {clash} again"
            model.setdefault(key, {}).update(part.get(key) or {})
    return model


@pytest.mark.parametrize("name", COMPOSE_FILES)
def test_compose_files_follow_the_compose_specification(name):
    schema = json.loads((ROOT / "tests" / "schemas" / "compose-spec.json").read_text())
    validator = jsonschema.Draft7Validator(schema)  # its $schema names draft 7 without the trailing '#'
    validator.validate(yaml.safe_load((ROOT / name).read_text()))  # as written
    validator.validate(load(name))  # as compose runs it, .env filled in
    with pytest.raises(jsonschema.ValidationError):
        validator.validate({"services": {"api": {"imgae": "x"}}})


@pytest.fixture(scope="module", params=["compose.yaml", "split"])
def compose(request) -> dict:
    """One host (compose.yaml), or the head and GPU node files as two hosts run them."""
    if request.param == "compose.yaml":
        return load("compose.yaml")
    head, gpu = load("compose.head.yaml"), load("compose.gpu.yaml")
    return {"services": {**head["services"], **gpu["services"]}, "volumes": {**head["volumes"], **gpu["volumes"]}}


def workers(compose) -> dict[str, list[str]]:
    return {name: s["command"] for name, s in compose["services"].items() if s.get("command", [])[:2] == ["lmsp", "worker"]}


def test_compose_services_refer_to_what_exists(compose):
    services, volumes = compose["services"], compose.get("volumes") or {}
    long_running = {name for name, s in services.items() if s.get("restart") != "no"}
    for name, service in services.items():
        for dep, cond in service.get("depends_on", {}).items():
            assert dep in services, f"{name} depends on unknown {dep}"
            wanted = cond["condition"]
            assert wanted in ("service_started", "service_healthy", "service_completed_successfully")
            assert wanted != "service_healthy" or "healthcheck" in services[dep]
            assert wanted != "service_completed_successfully" or dep not in long_running
        for mount in service.get("volumes", []):
            source = mount.split(":")[0]
            assert (ROOT / source).exists() if source.startswith(".") else source in volumes, mount
        if "build" in service:
            assert service["build"]["target"] in stages()
            assert (ROOT / service["build"]["dockerfile"]).exists()
        if name in long_running:
            assert "healthcheck" in service, f"{name} has no healthcheck"
        for key in service.get("environment", {}):
            assert not key.startswith("LMSP_") or key in SETTINGS_ENV, f"{name}: {key} is read by nothing"


def test_compose_runs_one_worker_service_per_model_on_its_own_gpus(compose, registry=None):
    services = compose["services"]
    registry = registry or Registry.load(ROOT / "compose.models.yaml")
    seen_models, seen_gpus = set(), set()
    for name, argv in workers(compose).items():
        service = services[name]
        ids, gpus = argv[argv.index("--model") + 1].split(","), argv[argv.index("--gpus") + 1]  # a model or a set
        per_worker = int(argv[argv.index("--tensor-parallel") + 1]) if "--tensor-parallel" in argv else 1
        assert set(ids) <= set(registry.models) and not set(ids) & seen_models
        indices = [int(g) for g in gpus.split(",")]
        assert not seen_gpus & set(indices), f"{name}: a GPU in two services"
        seen_models |= set(ids)
        seen_gpus |= set(indices)
        # The healthcheck asks every worker's port: 9400 + N for N in range(workers of --gpus).
        port = Settings.model_fields["worker_metrics_port"].default
        assert f"{{{port} + n}}/readyz" in service["healthcheck"]["test"][-1]
        assert f"range({len(indices) // per_worker})" in service["healthcheck"]["test"][-1]
        drain = float(service["environment"]["LMSP_DRAIN_SECONDS"])
        assert int(service["stop_grace_period"].rstrip("s")) >= drain + 30
        # Worker ids are the host's own name (uts: host): no per-host setting that a copied .env repeats.
        assert service["uts"] == "host" and "hostname" not in service
        assert service["deploy"]["resources"]["reservations"]["devices"]
        assert service["environment"]["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
        assert service["build"]["target"] == "gpu"
    assert seen_models == set(registry.models), "a registered model with no worker service"
    for spec in registry.models.values():  # as k8s/config.yaml: any GPU generation, CUDA graphs on
        assert spec.engine["dtype"] == "auto" and spec.engine["enforce_eager"] is False
    for name in ("api", "migrate", "pull"):
        assert services[name]["build"]["target"] == "cpu"  # no GPU image where no GPU is used


def test_head_publishes_on_the_private_address_and_gpu_nodes_reach_it_with_passwords():
    head, gpu = load("compose.head.yaml"), load("compose.gpu.yaml")
    addr, redis_pw, pg_pw = ENV["LMSP_HEAD_ADDR"], ENV["REDIS_PASSWORD"], ENV["POSTGRES_PASSWORD"]
    assert set(gpu["services"]) == set(workers(gpu)), "a GPU node runs workers only"
    assert {"postgres", "redis", "migrate", "api"} <= set(head["services"]) and not workers(head)
    for name in ("postgres", "redis", "api"):
        for port in head["services"][name]["ports"]:
            assert port.startswith(addr + ":"), f"{name} published beyond the private address: {port}"
    assert head["services"]["redis"]["command"][-2:] == ["--requirepass", redis_pw]
    for service in head["services"].values():
        env = service.get("environment", {})
        if "LMSP_DATABASE_URL" in env:  # on the head: by service name, inside its network
            assert env["LMSP_DATABASE_URL"] == f"postgresql://lmsp:{pg_pw}@postgres:5432/lmsp"
            assert env["LMSP_BROKER_URL"] == env["LMSP_REDIS_URL"] == f"redis://:{redis_pw}@redis:6379/0"
    for service in gpu["services"].values():
        env = service["environment"]
        assert env["LMSP_DATABASE_URL"] == f"postgresql://lmsp:{pg_pw}@{addr}:5432/lmsp"
        assert env["LMSP_BROKER_URL"] == env["LMSP_REDIS_URL"] == f"redis://:{redis_pw}@{addr}:6379/0"
        assert service["uts"] == "host"
    assert "LMSP_HOST_NAME" not in ENV, "a per-host name in the shared .env collides when copied"
    for name, wanted in (("compose.gpu.yaml", "LMSP_HEAD_ADDR"), ("compose.head.yaml", "REDIS_PASSWORD")):
        with pytest.raises(AssertionError, match=wanted):  # a missing setting stops compose with its name
            load(name, {k: v for k, v in ENV.items() if k != wanted})


# -- day-one operations (issue 35) ---------------------------------------------------------------------------
def test_the_commented_multi_model_worker_service_is_valid_once_uncommented(tmp_path):
    text = (ROOT / "compose.gpu.yaml").read_text()
    block = re.search(r"^  # worker-small-set:\n(?:^  #.*\n)+", text, re.M).group(0)
    live = text.replace(block, "".join(line.replace("  # ", "  ", 1).replace("  #", "", 1) + "\n"
                                       for line in block.splitlines()))
    (tmp_path / "compose.gpu.yaml").write_text(live)
    gpu = load(str(tmp_path / "compose.gpu.yaml"))   # an absolute path: ROOT / it is it
    argv = gpu["services"]["worker-small-set"]["command"]
    ids = argv[argv.index("--model") + 1].split(",")
    assert len(ids) >= 2
    env = gpu["services"]["worker-small-set"]["environment"]
    assert float(env["LMSP_WORKER_MEMORY_BUDGET_GIB"]) > 0 and env["LMSP_DATABASE_URL"]
    registry = Registry.load(ROOT / "compose.models.yaml")
    for model_id in ids:
        registry.put(registry.models["smollm2:135m"].model_copy(update={"id": model_id}))
    both = {"services": {**load("compose.head.yaml")["services"], **gpu["services"]}}
    test_compose_runs_one_worker_service_per_model_on_its_own_gpus(both, registry)


def test_one_model_the_head_cannot_pull_does_not_keep_the_api_down(tmp_path):
    """The head's pull tries each model; the api waits for it to end, not for every model to be there
    (the api answers 503 model_unavailable for a model whose files are missing)."""
    head = load("compose.head.yaml")
    pull = head["services"]["pull"]["command"]
    assert pull[:3] == ["lmsp", "models", "pull"] and "--keep-going" in pull and "--tokenizer-only" in pull
    assert head["services"]["api"]["depends_on"]["pull"]["condition"] == "service_completed_successfully"
    (tmp_path / "here").mkdir()
    models = {"models": [
        {"id": "gated:1", "checkpoint": str(tmp_path / "only-the-gpu-nodes-have-it.gguf"), "context_window": 64,
         "max_output_tokens": 16},
        {"id": "here:1", "checkpoint": str(tmp_path / "here"), "context_window": 64, "max_output_tokens": 16}]}
    (tmp_path / "models.yaml").write_text(yaml.safe_dump(models))
    env = {**os.environ, "LMSP_MODELS_FILE": str(tmp_path / "models.yaml"), "LMSP_HOME": str(tmp_path / "home")}
    lmsp = [sys.executable, "-m", "lmsp"]
    done = subprocess.run([*lmsp, *pull[1:]], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\t")[0] == "here:1"          # the model it could pull, pulled
    assert "not pulled: model gated:1" in done.stderr and "1 of 2 models not pulled (gated:1)" in done.stderr
    alone = subprocess.run([*lmsp, "models", "pull", "--all"], env=env, capture_output=True, text=True, timeout=120)
    assert alone.returncode == 1 and "here:1" not in alone.stdout   # without it: stops at the first


def test_the_readmes_deployment_sections_state_the_driver_and_end_with_doctor():
    readme = (ROOT / "README.md").read_text()
    deploying = readme[readme.index("## Deploying"):readme.index("### What a scale-down")]
    assert "CUDA 13" in deploying   # torch 2.13's CUDA wheels: the GPU hosts' driver must support it
    sections = re.split(r"^### ", deploying, flags=re.M)[1:]
    shapes = [s for s in sections if s.startswith(("1. ", "2. ", "3. "))]
    assert len(shapes) == 3
    for section in shapes:
        assert "lmsp doctor" in section, section.splitlines()[0]
    assert "psql" not in deploying and "keda-role.sql" not in deploying   # the migrate Job makes KEDA's role
