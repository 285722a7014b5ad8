"""What the chaos run puts around its own servers (tests/servers.py): a TCP proxy in front of both, and
a small filesystem for the event log's tablespace."""

import asyncio
import shutil
import subprocess
import threading
import time
from pathlib import Path

from tests.harness import free_port
from tests.servers import PgCluster


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
