"""Several hosts without Kubernetes, rehearsed on this machine: three network namespaces stand in for a
head node and two GPU nodes, each with its own address on one private network (a bridge). Each runs
the processes its compose file's services run, with those services' commands and environment read
from compose.head.yaml / compose.gpu.yaml and .env (the image's ENV from the Containerfile, named
volumes as per-host folders): on the head Postgres and Redis (with its password) bound to the head's
private address, `lmsp migrate`, the tokenizer pull and `lmsp serve`; on each GPU node `lmsp worker`
reaching the head's address. Then a client of the head's api has its tasks run by the GPU nodes'
workers, one node after the other.

Not in `make test` (two engines load at once: minutes on 2 cores): `make test-hosts`, as root (it makes
namespaces, a bridge and /etc/netns/<ns>/hosts). What differs from the real thing: no containers (the
venv's `lmsp` stands in for the image's), Postgres and Redis are this machine's binaries, no GPU (the
worker runs vLLM on CPU with the tests' engine settings and --gpus 0 instead of 0,1), and each host's
Hugging Face cache is the default model laid out as a hub snapshot, offline (no hub here)."""

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import psycopg
import pytest
import redis
import requests
import yaml

from tests.harness import CHECKPOINT, model_entry, wait_for
from tests.hubcache import lay_out_snapshot
from tests.unit.test_deploy import env_of, load, stages

ROOT = Path(__file__).resolve().parents[2]
NET = "10.231.7"  # a /24 that lives only on the bridge below, inside this machine
HOSTS = {"head": f"{NET}.1", "gpu1": f"{NET}.2", "gpu2": f"{NET}.3"}
BRIDGE = "lmsp-rh0"
pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("ip"), reason="needs root and iproute2")


def sh(*argv, **kw):
    done = subprocess.run(argv, capture_output=True, text=True, **kw)
    assert done.returncode == 0, f"{' '.join(argv)}: {done.stderr}"
    return done


def ns(host: str) -> str:
    return f"lmsp-rh-{host}"


class Hosts:
    def __init__(self, tmp: Path):
        self.tmp, self.procs, self.tag = tmp, [], uuid.uuid4().hex[:6]
        self.env_file = {  # .env as an operator fills it in from .env.example
            "LMSP_HEAD_ADDR": HOSTS["head"], "POSTGRES_PASSWORD": "pg-" + self.tag,
            "REDIS_PASSWORD": "redis-" + self.tag, "LMSP_HOST_NAME": "unset", "LMSP_LOG_FORMAT": "text"}

    def up(self) -> None:
        self.pg = Path(tempfile.mkdtemp(prefix="lmsp-rh-pg-"))  # the postgres user's: outside pytest's 0700 tmp
        self.pg.chmod(0o755)
        shutil.chown(self.pg, "postgres")
        sh("ip", "link", "add", BRIDGE, "type", "bridge")
        sh("ip", "addr", "add", f"{NET}.254/24", "dev", BRIDGE)  # the client's seat on the private network
        sh("ip", "link", "set", BRIDGE, "up")
        for n, (host, addr) in enumerate(HOSTS.items()):
            sh("ip", "netns", "add", ns(host))
            sh("ip", "link", "add", f"lmsp-rh{n}a", "type", "veth", "peer", "name", f"lmsp-rh{n}b")
            sh("ip", "link", "set", f"lmsp-rh{n}b", "master", BRIDGE, "up")
            sh("ip", "link", "set", f"lmsp-rh{n}a", "netns", ns(host))
            for cmd in (["ip", "link", "set", "lo", "up"], ["ip", "addr", "add", f"{addr}/24", "dev", f"lmsp-rh{n}a"],
                        ["ip", "link", "set", f"lmsp-rh{n}a", "up"]):
                sh("ip", "netns", "exec", ns(host), *cmd)
            # compose's service names resolve inside the head's project network: here, to the head itself.
            etc = Path("/etc/netns") / ns(host)
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(f"127.0.0.1 localhost\n{HOSTS['head']} postgres redis\n")

    def down(self) -> None:
        for proc in reversed(self.procs):  # workers first, Postgres last: each stops while what it needs runs
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(90)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        for host in HOSTS:
            subprocess.run(["ip", "netns", "del", ns(host)], capture_output=True)
            shutil.rmtree(Path("/etc/netns") / ns(host), ignore_errors=True)
        subprocess.run(["ip", "link", "del", BRIDGE], capture_output=True)
        shutil.rmtree(self.pg, ignore_errors=True)

    def run(self, host: str, argv: list[str], env: dict | None = None, log: str | None = None, user: str | None = None,
            hostname: str | None = None) -> subprocess.Popen:
        prefix = ["ip", "netns", "exec", ns(host)]
        if hostname:  # a container's hostname: worker ids are host:gpuN
            argv = ["unshare", "--uts", "sh", "-c", f'hostname {hostname} && exec "$@"', "sh", *argv]
        if user:
            argv = ["runuser", "-u", user, "--", *argv]
        out = open(self.tmp / (log or f"{host}.log"), "ab")
        proc = subprocess.Popen(prefix + argv, env=env or os.environ.copy(), cwd=ROOT, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(proc)
        return proc

    def service_env(self, compose: dict, service: str, host: str, models_file: Path) -> dict:
        """What the container of ``service`` would see: the image's ENV, the service's environment,
        container paths of its volumes mapped to this host's folders."""
        spec = compose["services"][service]
        image = env_of(spec["build"]["target"], stages())
        env = {k: v for k, v in {**image, **spec.get("environment", {})}.items()
               if k != "PATH" and not k.startswith("NVIDIA_")}
        home = self.tmp / f"{host}-home"
        mounts = {"/var/lib/lmsp": str(home), "/etc/lmsp/models.yaml": str(models_file)}
        for key, value in env.items():
            for target, source in mounts.items():
                if isinstance(value, str) and value.startswith(target):
                    env[key] = source + value[len(target):]
        lay_out_snapshot(CHECKPOINT, Path(env["HF_HOME"]))  # as if this host had pulled it
        return {**os.environ, **{k: str(v) for k, v in env.items()}, "HF_HUB_OFFLINE": "1",
                "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}


def lmsp_argv(command: list[str]) -> list[str]:
    assert command[0] == "lmsp"
    return [sys.executable, "-m", "lmsp", *command[1:]]


@pytest.fixture
def hosts(tmp_path):
    h = Hosts(tmp_path)
    try:
        h.up()
        yield h
    finally:
        h.down()


def test_gpu_nodes_workers_serve_the_head_nodes_api(hosts, tmp_path):
    head_file, gpu_file = load("compose.head.yaml", hosts.env_file), load("compose.gpu.yaml", hosts.env_file)
    registry = yaml.safe_load((ROOT / "compose.models.yaml").read_text())["models"]
    # On CPU: the tests' engine settings (eager, float32, 1 GiB of KV cache), the same id and repo id.
    models = tmp_path / "models.yaml"
    models.write_text(yaml.safe_dump({"models": [model_entry(m["id"], checkpoint=m["checkpoint"]) for m in registry]}))
    head_addr, pg_pw, redis_pw = HOSTS["head"], hosts.env_file["POSTGRES_PASSWORD"], hosts.env_file["REDIS_PASSWORD"]

    # -- head: Postgres and Redis as the compose services configure them, on the private address only
    pg, pw = hosts.pg / "data", hosts.pg / "pw"
    pw.write_text(pg_pw)
    shutil.chown(pw, "postgres")
    sh("runuser", "-u", "postgres", "--", next(Path("/usr/lib/postgresql").glob("*/bin/initdb")).as_posix(),
       "-D", str(pg), "-U", "lmsp", f"--pwfile={pw}", "--auth=scram-sha-256")
    (pg / "pg_hba.conf").write_text(f"host all all {NET}.0/24 scram-sha-256\n")
    postgres = next(Path("/usr/lib/postgresql").glob("*/bin/postgres")).as_posix()
    hosts.run("head", [postgres, "-D", str(pg), "-c", f"listen_addresses={head_addr}", "-c", "port=5432",
                       "-c", f"unix_socket_directories={pg}"], user="postgres", log="postgres.log")
    redis_cmd = head_file["services"]["redis"]["command"]
    assert redis_cmd[-2:] == ["--requirepass", redis_pw]
    (tmp_path / "redis").mkdir()
    hosts.run("head", [*redis_cmd, "--bind", head_addr, "--dir", str(tmp_path / "redis"), "--save", ""],
              log="redis.log")
    admin = f"postgresql://lmsp:{pg_pw}@{head_addr}:5432/postgres"
    wait_for(lambda: _connects(admin), 60, "Postgres did not start")
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute("CREATE DATABASE lmsp")  # compose's POSTGRES_DB

    # -- head: migrate, pull (tokenizers), api: each service's command and environment
    env = {s: hosts.service_env(head_file, s, "head", models) for s in ("migrate", "pull", "api")}
    for service in ("migrate", "pull"):
        done = hosts.run("head", lmsp_argv(head_file["services"][service]["command"]), env[service],
                         log=f"{service}.log").wait(300)
        assert done == 0, (tmp_path / f"{service}.log").read_text()[-3000:]
    hosts.run("head", lmsp_argv(head_file["services"]["api"]["command"]), env["api"], log="api.log")
    api = f"http://{head_addr}:8080"
    wait_for(lambda: _ok(api + "/readyz"), 120, "the api did not start")

    # -- GPU nodes: their workers, reaching the head at LMSP_HEAD_ADDR with the .env passwords
    workers = {}
    for node in ("gpu1", "gpu2"):
        (name, service), = gpu_file["services"].items()
        argv = lmsp_argv(service["command"])
        argv[argv.index("--gpus") + 1] = "0"  # one engine per node: 2 cores
        wenv = hosts.service_env(gpu_file, name, node, models)
        assert wenv["LMSP_DATABASE_URL"] == f"postgresql://lmsp:{pg_pw}@{head_addr}:5432/lmsp"
        workers[node] = hosts.run(node, argv, wenv, log=f"{node}.log", hostname=f"{node}-{hosts.tag}")
    # Redis refuses a client without the password, from another host
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis(host=head_addr, socket_timeout=5).ping()

    token = sh("ip", "netns", "exec", ns("head"), *lmsp_argv(["lmsp", "tokens", "create", "--principal", "alice"]),
               env=env["api"], cwd=ROOT).stdout.strip()
    http = requests.Session()
    http.trust_env = False  # straight to the head's address: no proxy from the environment
    http.headers["Authorization"] = f"Bearer {token}"
    model = registry[0]["id"]

    def workers_up() -> int:
        found = [m for m in http.get(api + "/lmsp/v1/models", timeout=10).json()["data"] if m["id"] == model]
        return found[0]["workers"] if found else 0

    wait_for(lambda: workers_up() == 2, 900, "the GPU nodes' workers did not come up")

    def run_tasks(n: int) -> set[str]:
        ids = []
        for i in range(n):
            r = http.post(api + "/lmsp/v1/tasks", json={"type": "response", "input": {
                "model": model, "input": [{"type": "message", "role": "user", "content": [
                    {"type": "input_text", "text": f"Count to {i + 3}."}]}], "max_output_tokens": 8}}, timeout=30)
            assert r.status_code == 202, r.text
            ids.append(r.json()["id"])
        for tid in ids:
            wait_for(lambda tid=tid: http.get(f"{api}/lmsp/v1/tasks/{tid}", timeout=10).json()["status"]
                     in ("succeeded", "failed", "cancelled"), 600, f"task {tid} did not finish")
            assert http.get(f"{api}/lmsp/v1/tasks/{tid}", timeout=10).json()["status"] == "succeeded"
        with psycopg.connect(f"postgresql://lmsp:{pg_pw}@{head_addr}:5432/lmsp") as conn:
            return {row[0] for row in conn.execute("SELECT worker_id FROM tasks WHERE id = ANY(%s)", (ids,))}

    both = {f"gpu1-{hosts.tag}:gpu0", f"gpu2-{hosts.tag}:gpu0"}
    first = run_tasks(6)
    assert first and first <= both, first
    # Each node serves: stop whichever ran the first batch's tasks, and the other runs the next batch.
    stopped = "gpu1" if f"gpu1-{hosts.tag}:gpu0" in first else "gpu2"
    os.killpg(workers[stopped].pid, signal.SIGTERM)
    assert workers[stopped].wait(180) == 0
    other = ({"gpu1", "gpu2"} - {stopped}).pop()
    assert run_tasks(3) == {f"{other}-{hosts.tag}:gpu0"}
    log = (tmp_path / f"{other}.log").read_text()
    assert re.search(rf"loading {re.escape(model)} from .*/{other}-home/hf/hub/models--", log)


def _connects(url: str) -> bool:
    try:
        psycopg.connect(url, connect_timeout=2).close()
        return True
    except psycopg.OperationalError:
        return False


def _ok(url: str) -> bool:
    try:
        return requests.get(url, timeout=3).ok
    except requests.RequestException:
        return False
