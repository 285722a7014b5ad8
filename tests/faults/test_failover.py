"""Postgres failover loses nothing acknowledged (issue 36; DESIGN.md invariant 16; README, "Postgres for zero
loss"). Two clusters on this machine: a primary and a streaming standby made with pg_basebackup. The
service gets both in one libpq multi-host URL with ``target_session_attrs=read-write`` and, with nothing
restarted, follows the primary when it moves.

* The replication itself: with the standby's WAL receiver frozen (SIGSTOP), a commit acknowledged under
  asynchronous replication is gone after the primary dies and the standby is promoted; under synchronous
  replication (``synchronous_standby_names``) the commit is never acknowledged, and nothing acknowledged
  is lost.
* The service on it (its own api and worker on the simulated engine): tasks submitted before and during
  the failover, followed over SSE and WebSocket; the primary is killed (an immediate stop: a crash) and
  the standby promoted while they generate. Every task that got a 202 is there and ends as its policy
  says, every event a follower received is in the new primary's log, the logs have no gap, and every
  follower gets every event once and one final event.

Its own servers and processes: it runs in the faults lane. ~60 s."""

import os
import shutil
import subprocess
import tempfile
import threading
import time
import uuid
from pathlib import Path

import psutil
import psycopg
import pytest
import requests

from tests.bench.fleet_load import Fleet, Loop, check, follow, read_log, task_body
from tests.harness import CHECKPOINT, create_database, wait_for
from tests.servers import PgCluster, _as_postgres

pytestmark = pytest.mark.skipif(not (CHECKPOINT / "config.json").exists(), reason="default model not imported")
SIM = {"kind": "sim", "max_num_seqs": 32, "ttft_ms": 50, "tokens_per_s": 20, "tick_ms": 50}
POLICIES = ("fail", "retry", "resume")


class Standby(PgCluster):
    """A streaming standby of ``primary`` (pg_basebackup), named ``standby1`` to it."""

    def __init__(self, root: Path, primary: PgCluster):
        self.bin, self.data, self.log = primary.bin, root / "pgdata", root / "postgres.log"
        from tests.harness import free_port
        self.port = free_port()
        root.mkdir(parents=True, exist_ok=True)
        if os.geteuid() == 0:
            shutil.chown(root, "postgres")
        subprocess.run([*_as_postgres(), str(self.bin / "pg_basebackup"), "-h", "127.0.0.1", "-p", str(primary.port),
                        "-U", "postgres", "-D", str(self.data), "-X", "stream", "--no-sync",
                        "--checkpoint=fast"],  # a spread checkpoint first took 30-90 s under the chaos load
                       check=True, capture_output=True)
        (self.data / "standby.signal").touch()
        with open(self.data / "postgresql.auto.conf", "a") as conf:  # read last: over the primary's settings
            conf.write(f"port = {self.port}\nunix_socket_directories = '{root}'\n"
                       f"primary_conninfo = 'host=127.0.0.1 port={primary.port} user=postgres "
                       "application_name=standby1'\n")
        if os.geteuid() == 0:
            subprocess.run(["chown", "-R", "postgres", str(root)], check=True)
        self.start()


def _postmaster(cluster: PgCluster) -> psutil.Process:
    return psutil.Process(int((cluster.data / "postmaster.pid").read_text().split()[0]))


def _walsender(primary: PgCluster) -> psutil.Process:
    def named(proc: psutil.Process) -> str:
        try:
            return " ".join(proc.cmdline())
        except psutil.NoSuchProcess:  # a backend that just ended (a zombie until the postmaster reaps it)
            return ""
    found = [p for p in _postmaster(primary).children() if "walsender" in named(p)]
    assert found, "no WAL sender"
    return found[0]


def _crash(cluster: PgCluster) -> None:
    """SIGKILL the server and every process of it (a stopped one too): a machine lost."""
    postmaster = _postmaster(cluster)
    for proc in [*postmaster.children(), postmaster]:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass  # a backend that ended between the listing and the kill (a client's commit done)
    psutil.wait_procs([postmaster], timeout=10)


@pytest.fixture
def pair():
    root = Path(tempfile.mkdtemp(prefix="lmsp-failover-"))
    os.chmod(root, 0o755)
    primary = PgCluster(root / "primary")
    standby = Standby(root / "standby", primary)
    with primary.connect() as conn:
        wait_for(lambda: conn.execute("SELECT count(*) FROM pg_stat_replication WHERE application_name = "
                                      "'standby1' AND state = 'streaming'").fetchone()[0] == 1, 60, "no streaming")
    yield primary, standby
    for cluster in (standby, primary):
        cluster.close()
    shutil.rmtree(root, ignore_errors=True)


def _replication(primary: PgCluster, mode: str) -> None:
    with primary.connect() as conn:
        conn.execute(f"ALTER SYSTEM SET synchronous_standby_names = '{'standby1' if mode == 'sync' else ''}'")
        conn.execute("SELECT pg_reload_conf()")
        want = "sync" if mode == "sync" else "async"
        wait_for(lambda: conn.execute("SELECT sync_state FROM pg_stat_replication").fetchone()[0] == want, 30,
                 f"replication not {want}")


def _fail_over(primary: PgCluster, standby: Standby) -> None:
    primary.stop("immediate")  # a crash: no shutdown checkpoint, nothing sent after
    standby.ctl("promote")


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_what_a_failover_loses_under_each_replication(pair, mode):
    """The README's claim, shown on Postgres itself: a commit the standby has not received is lost by an
    asynchronous failover although it was acknowledged; a synchronous one acknowledges nothing the standby
    lacks (the commit waits), so nothing acknowledged is lost."""
    primary, standby = pair
    _replication(primary, mode)
    with primary.connect() as conn:
        conn.execute("CREATE TABLE acks (n int)")
        conn.execute("INSERT INTO acks VALUES (1)")
        wait_for(lambda: conn.execute("SELECT replay_lsn = pg_current_wal_lsn() FROM pg_stat_replication")
                 .fetchone()[0], 30, "standby behind")
    _walsender(primary).suspend()  # nothing more reaches the standby: a network stall, a slow standby
    acknowledged = []

    def commit_two():
        try:
            with primary.connect() as conn:
                conn.execute("INSERT INTO acks VALUES (2)")
                acknowledged.append(2)
        except psycopg.Error:
            pass  # the server died under the commit: not acknowledged
    writer = threading.Thread(target=commit_two, daemon=True)
    writer.start()
    writer.join(3)
    _crash(primary)
    writer.join(10)
    standby.ctl("promote")
    wait_for(lambda: _is_primary(standby), 60, "standby not promoted")
    with standby.connect() as conn:
        there = {n for (n,) in conn.execute("SELECT n FROM acks")}
    if mode == "async":
        assert acknowledged == [2] and there == {1}, (acknowledged, there)  # acknowledged, then lost
    else:
        assert acknowledged == [] and there == {1}  # never acknowledged: nothing acknowledged is lost


def _is_primary(cluster: PgCluster) -> bool:
    try:
        with cluster.connect() as conn:
            return not conn.execute("SELECT pg_is_in_recovery()").fetchone()[0]
    except psycopg.Error:
        return False


def test_the_service_follows_a_synchronous_failover_and_loses_nothing_acknowledged(pair, redis_url, tmp_path):
    primary, standby = pair
    _replication(primary, "sync")
    name = create_database(server=primary.url()).rsplit("/", 1)[1]
    url = (f"postgresql://postgres@127.0.0.1:{primary.port},127.0.0.1:{standby.port}/{name}"
           "?target_session_attrs=read-write")  # the README's form
    from common.db import upgrade
    upgrade(url)
    fleet = Fleet(tmp_path, url, f"sim:fo{uuid.uuid4().hex[:6]}", engine=SIM,
                  env={"LMSP_BROKER_URL": redis_url, "LMSP_REDIS_URL": redis_url})
    loop = Loop()
    try:
        fleet.spawn_workers(["fo-1"])
        base = fleet.start_apis(1, threads=64)[0]
        token = fleet.stack.token("failover")
        fleet.wait_workers(["fo-1"])
        _run(fleet, loop, base, token, primary, standby, url, name)
    finally:
        loop.close()
        fleet.close(graceful=False)


def _run(fleet, loop, base, token, primary, standby, url, name):
    accepted: dict[str, str] = {}  # task id -> policy: every 202
    refused = []

    def submit(i: int) -> None:
        policy = POLICIES[i % 3]
        try:
            r = requests.post(base + "/lmsp/v1/tasks", json=task_body(fleet.model, f"failover {i}", 60, policy),
                              headers={"Authorization": f"Bearer {token}"}, timeout=30)
        except requests.RequestException as exc:
            refused.append(type(exc).__name__)
            return
        if r.status_code == 202:
            accepted[r.json()["id"]] = policy
        else:
            refused.append(r.status_code)

    for i in range(12):
        submit(i)
    before = set(accepted)
    futures = {}

    def follow_all():
        for n, task_id in enumerate(list(accepted)):
            if task_id not in futures:
                futures[task_id] = loop.spawn(follow(loop.http, base, token, task_id, "sse" if n % 2 else "ws",
                                                     deadline=150))
    follow_all()
    with psycopg.connect(primary.url(db=name)) as conn:
        wait_for(lambda: conn.execute("SELECT count(*) FROM tasks WHERE status = 'running'").fetchone()[0] >= 3,
                 60, "no task running")
    stop = threading.Event()

    def keep_submitting():
        i = 100
        while not stop.is_set():
            submit(i)
            i += 1
            time.sleep(0.2)
    submitter = threading.Thread(target=keep_submitting, daemon=True)
    submitter.start()
    time.sleep(0.5)
    _fail_over(primary, standby)
    time.sleep(6)  # submissions go on through the failover and after it
    stop.set()
    submitter.join(40)
    follow_all()
    followed = [f.result(timeout=200) for f in futures.values()]
    log = read_log(url, list(accepted))
    c = check(followed, log)
    print(f"failover: {len(accepted)} tasks accepted ({len(refused)} refused: {sorted(map(str, set(refused)))}), "
          f"{c.events} events to {len(followed)} followers, {c.stream_errors} streams resumed")
    assert c.unfinished == 0, [f.error for f in followed if not f.ended][:5]
    assert (c.lost, c.duplicated, c.out_of_order, c.finals_wrong) == (0, 0, 0, 0), c
    for rec in followed:  # what a follower was sent had been committed: the new primary has it
        got, logged = {seq for seq, _, _ in rec.events}, [seq for seq, _, _ in log[rec.task_id]]
        assert got <= set(logged), (rec.task_id, sorted(got - set(logged)))
        assert logged == list(range(1, len(logged) + 1)), (rec.task_id, logged)  # once each, no gap
    with psycopg.connect(standby.url(db=name)) as conn:
        rows = {tid: (status, error) for tid, status, error in conn.execute(
            "SELECT id, status, error FROM tasks WHERE id = ANY(%s)", (list(accepted),)).fetchall()}
    assert set(rows) == set(accepted), "a task that got a 202 is gone"
    assert set(accepted) - before, "no task was accepted after the failover began"
    for task_id, policy in accepted.items():
        status, error = rows[task_id]
        if policy == "fail":  # its attempt may have been handed on if its lease ran out meanwhile
            assert status == "succeeded" or (status == "failed" and error["code"] == "server_restarted"), \
                (task_id, status, error)
        else:
            assert status == "succeeded", (task_id, policy, status, error)
