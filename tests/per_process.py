"""Requests answered by each process of a gunicorn api, told apart: which worker process accepted a
connection is seen from the server's side of its socket (psutil), while the connection is open."""

import http.client
import time
from urllib.parse import urlsplit

import psutil


def token_id(stack, principal: str) -> str:
    """The id of ``principal``'s token, as `lmsp tokens list` shows it."""
    return next(line.split()[0] for line in stack.lmsp("tokens", "list").stdout.splitlines()
                if f" {principal} " in line)


class PerProcess:
    def __init__(self, base: str, master: psutil.Process | int):
        self.host, self.port = urlsplit(base).hostname, urlsplit(base).port
        self.master = master if isinstance(master, psutil.Process) else psutil.Process(master)

    def workers(self) -> set[int]:
        return {p.pid for p in self.master.children()}

    def _served_by(self, local_port: int) -> int | None:
        for child in self.master.children():
            for conn in child.net_connections(kind="tcp"):
                if conn.laddr.port == self.port and conn.raddr and conn.raddr.port == local_port:
                    return child.pid
        return None

    def one(self, token: str, path: str = "/lmsp/v1/models") -> tuple[int | None, int]:
        """(the pid that answered, the status) of one request on a new connection."""
        conn = http.client.HTTPConnection(self.host, self.port, timeout=10)
        try:
            conn.request("GET", path, headers={"Authorization": f"Bearer {token}"})
            resp = conn.getresponse()
            resp.read()
            return self._served_by(conn.sock.getsockname()[1]), resp.status
        finally:
            conn.close()

    def every(self, token: str, path: str = "/lmsp/v1/models", tries: int = 200) -> dict[int, int]:
        """The status of the first request each worker process answered (new connections until every
        one has answered)."""
        wanted, seen = self.workers(), {}
        for _ in range(tries):
            pid, status = self.one(token, path)
            if pid is not None:
                seen.setdefault(pid, status)
            if set(seen) >= wanted:
                return seen
        raise AssertionError(f"only processes {sorted(seen)} of {sorted(wanted)} answered in {tries} connections")

    def until_every(self, token: str, status: int, timeout: float, path: str = "/lmsp/v1/models") -> float:
        """Seconds until every worker process answers ``status`` (each one's latest answer)."""
        start, latest = time.monotonic(), {}
        wanted = self.workers()
        while True:
            pid, got = self.one(token, path)
            if pid is not None:
                latest[pid] = got
            if set(latest) >= wanted and all(s == status for s in latest.values()):
                return time.monotonic() - start
            if time.monotonic() - start > timeout:
                raise AssertionError(f"after {timeout} s the processes answered {latest}, not all {status}")
            time.sleep(0.05)
