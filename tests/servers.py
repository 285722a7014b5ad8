"""Private Postgres and Redis servers for runs that stop, restart or flush them (the fault tests, the
chaos run), never the shared ones on 5432 and 6379 that every other test uses."""

import glob
import os
import shutil
import signal
import subprocess
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
