"""The chaos run's own servers, so it can restart, flush and fill them without touching the shared
Postgres (5432) and Redis (6379) other people's tests use: a Postgres cluster in a temporary folder,
a redis-server, a TCP proxy in front of both, and a small filesystem for the event log's tablespace."""

import asyncio
import glob
import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import psycopg
import redis

from tests.harness import free_port, wait_for


def _as_postgres() -> list[str]:
    # initdb and postgres refuse to run as root.
    return ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []


class PgCluster:
    def __init__(self, root: Path):
        self.bin = Path(sorted(glob.glob("/usr/lib/postgresql/*/bin"))[-1])
        self.data = root / "pgdata"
        self.port = free_port()
        self.log = root / "postgres.log"
        root.mkdir(parents=True, exist_ok=True)
        if os.geteuid() == 0:
            shutil.chown(root, "postgres")
        subprocess.run([*_as_postgres(), str(self.bin / "initdb"), "-D", str(self.data), "-U", "postgres",
                        "--auth=trust", "-E", "UTF8", "--no-sync"], check=True, capture_output=True)
        with open(self.data / "postgresql.conf", "a") as conf:
            # No fsync: an immediate stop (a crash of the server, not of the machine) loses nothing the OS holds.
            conf.write(f"port = {self.port}\nlisten_addresses = '127.0.0.1'\nunix_socket_directories = '{root}'\n"
                       "max_connections = 300\nfsync = off\nshared_buffers = 64MB\n")
        self.start()

    def url(self, port: int | None = None, db: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{port or self.port}/{db}"

    def ctl(self, *args: str) -> None:
        subprocess.run([*_as_postgres(), str(self.bin / "pg_ctl"), "-D", str(self.data), "-l", str(self.log),
                        "-w", "-t", "120", *args], check=True, capture_output=True)

    def start(self) -> None:
        self.ctl("start")

    def stop(self, mode: str = "fast") -> None:
        self.ctl("stop", "-m", mode)

    def connect(self, db: str = "postgres", **kw) -> psycopg.Connection:
        return psycopg.connect(self.url(db=db), autocommit=True, connect_timeout=5, **kw)

    def close(self) -> None:
        try:
            self.stop("immediate")
        except subprocess.CalledProcessError:
            pass


class RedisServer:
    def __init__(self, root: Path):
        self.port = free_port()
        self.root = root
        self.proc: subprocess.Popen | None = None
        self.start()

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, socket_timeout=5, socket_connect_timeout=2)

    def start(self) -> None:
        log = open(self.root / "redis.log", "ab")
        self.proc = subprocess.Popen(["redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
                                      "--save", "", "--appendonly", "no", "--dir", str(self.root)],
                                     stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        wait_for(self._pings, 30, "redis-server did not start")

    def _pings(self) -> bool:
        try:
            return self.client().ping()
        except redis.RedisError:
            return False

    def stop(self) -> None:
        """Down, and empty when it comes back (no save): what a restarted broker remembers."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)

    def close(self) -> None:
        self.stop()


class Proxy:
    """A TCP proxy on its own asyncio loop thread: one listening port per upstream. ``cut`` closes every
    open connection and refuses new ones (a network partition that the peers notice); ``stall`` stops
    forwarding bytes while connections stay open (one they do not notice until their timeouts)."""

    def __init__(self, upstreams: dict[str, int]):
        self.upstreams = upstreams
        self.ports = {name: free_port() for name in upstreams}
        self.cut: set[str] = set()
        self.stalled: dict[str, asyncio.Event] = {}
        self.conns: dict[str, set] = {name: set() for name in upstreams}
        self.loop = asyncio.new_event_loop()
        self._servers = []
        ready = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(ready,), daemon=True, name="chaos-proxy")
        self.thread.start()
        ready.wait(10)

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        for name in self.upstreams:
            flowing = asyncio.Event()
            flowing.set()
            self.stalled[name] = flowing
            self._servers.append(self.loop.run_until_complete(asyncio.start_server(
                lambda r, w, n=name: self._serve(n, r, w), "127.0.0.1", self.ports[name])))
        ready.set()
        self.loop.run_forever()

    async def _serve(self, name: str, reader, writer) -> None:
        if name in self.cut:
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstreams[name])
        except OSError:
            writer.transport.abort()
            return
        pair = (writer, up_writer)
        self.conns[name].add(pair)
        try:
            await asyncio.gather(self._pump(name, reader, up_writer), self._pump(name, up_reader, writer))
        finally:
            self.conns[name].discard(pair)
            for w in pair:
                w.transport.abort()

    async def _pump(self, name: str, reader, writer) -> None:
        try:
            while data := await reader.read(65536):
                await self.stalled[name].wait()
                writer.write(data)
                await writer.drain()
        except (OSError, asyncio.CancelledError):
            pass
        finally:
            writer.transport.abort()

    def _call(self, fn) -> None:
        asyncio.run_coroutine_threadsafe(_as_coro(fn), self.loop).result(10)

    def set_cut(self, name: str, on: bool) -> None:
        def apply():
            if on:
                self.cut.add(name)
                for pair in list(self.conns[name]):
                    for w in pair:
                        w.transport.abort()
            else:
                self.cut.discard(name)
        self._call(apply)

    def set_stall(self, name: str, on: bool) -> None:
        self._call(lambda: self.stalled[name].clear() if on else self.stalled[name].set())

    def close(self) -> None:
        def stop():
            for s in self._servers:
                s.close()
            self.loop.stop()
        self.loop.call_soon_threadsafe(stop)
        self.thread.join(10)


async def _as_coro(fn):
    return fn()


class EventDisk:
    """A small tmpfs holding the event log's tablespace, so the run can fill that disk (and only that
    one: the WAL and every other table stay on the cluster's own). Needs mount (root in a container with
    CAP_SYS_ADMIN); ``arrange`` says why not when it cannot."""

    def __init__(self, root: Path, size_mib: int = 256):
        self.mount = root / "eventdisk"
        self.size_mib = size_mib
        self.mounted = False
        self.filler = self.mount / "filler"

    def arrange(self, pg: PgCluster, db: str) -> str | None:
        self.mount.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={self.size_mib}m", "tmpfs", str(self.mount)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            return f"cannot mount a tmpfs for the tablespace: {done.stderr.strip()}"
        self.mounted = True
        space = self.mount / "ts"
        space.mkdir()
        shutil.chown(space, "postgres")
        with pg.connect(db) as conn:
            conn.execute(f"CREATE TABLESPACE chaos_events LOCATION '{space}'")
            # The events table, its partitions if it has some, their indexes and TOAST tables.
            rels = conn.execute(
                "SELECT c.oid::regclass::text, c.relkind FROM pg_class c WHERE c.oid IN ("
                " SELECT 'events'::regclass UNION SELECT inhrelid FROM pg_inherits"
                " WHERE inhparent = 'events'::regclass)").fetchall()
            for rel, kind in rels:
                conn.execute(f"ALTER TABLE {rel} SET TABLESPACE chaos_events")
                for (index,) in conn.execute("SELECT indexrelid::regclass::text FROM pg_index WHERE indrelid = "
                                             f"'{rel}'::regclass").fetchall():
                    if kind != "p":
                        conn.execute(f"ALTER INDEX {index} SET TABLESPACE chaos_events")
        return None

    def fill(self) -> None:
        # dd stops at ENOSPC: the tablespace has no page left to extend a table or an index by.
        subprocess.run(["dd", "if=/dev/zero", f"of={self.filler}", "bs=1M"], capture_output=True)

    def free(self) -> None:
        self.filler.unlink(missing_ok=True)

    def close(self) -> None:
        if self.mounted:
            self.free()
            for _ in range(20):  # the cluster must be down first (it holds files there)
                if subprocess.run(["umount", str(self.mount)], capture_output=True).returncode == 0:
                    self.mounted = False
                    return
                time.sleep(0.5)
