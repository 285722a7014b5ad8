"""A TCP proxy for tests: one listening port per upstream, on its own asyncio loop thread.

It stands for the network between a client and a server: ``cut`` closes every open connection and
refuses new ones (a partition the peers notice); ``stall`` stops forwarding while connections stay
open (one they do not notice until their timeouts); a ``Link`` limits bandwidth and adds latency
(a slow WAN: a hotel link, a VPN). The chaos run puts it in front of Postgres and Redis; the
follower tests put a ``Link`` between a client and the api.

A shaped link forwards each direction through a queue that holds at most the link's
bandwidth-delay product plus ``buffer`` bytes in flight, so a sender feels backpressure as it would
on a real link (its kernel buffers fill) rather than the proxy buffering everything at once.
"""

import asyncio
import socket
import threading
import time
from dataclasses import dataclass

from tests.harness import free_port

CHUNK = 4096  # bytes forwarded at a time on a shaped link: its granularity


@dataclass(frozen=True)
class Link:
    """A link's shape: ``bits_per_s`` (0: unlimited) and one-way ``latency`` in seconds."""

    bits_per_s: float = 0.0
    latency: float = 0.0
    buffer: int = 64 * 1024  # bytes a "router" may hold beyond the bandwidth-delay product

    def bound_seconds(self, nbytes: int) -> float:
        """The time the link itself needs to carry ``nbytes`` (its own bound)."""
        return nbytes * 8 / self.bits_per_s + self.latency if self.bits_per_s else self.latency

    @property
    def in_flight(self) -> int:
        bdp = self.bits_per_s / 8 * self.latency * 2 if self.bits_per_s else 0
        return int(bdp) + self.buffer


class Proxy:
    """The proxy: ``upstreams`` maps a name to a port on 127.0.0.1; ``links`` shapes some of them."""

    def __init__(self, upstreams: dict[str, int], links: dict[str, Link] | None = None):
        self.upstreams = upstreams
        self.links = links or {}
        self.ports = {name: free_port() for name in upstreams}
        self.cut: set[str] = set()
        self.stalled: dict[str, asyncio.Event] = {}
        self.conns: dict[str, set] = {name: set() for name in upstreams}
        self.accepted: dict[str, int] = {name: 0 for name in upstreams}  # connections taken, per upstream
        self.loop = asyncio.new_event_loop()
        self._servers = []
        ready = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(ready,), daemon=True, name="test-proxy")
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
        self.accepted[name] += 1
        if name in self.cut:
            writer.transport.abort()
            return
        link = self.links.get(name)
        try:
            if link is None:
                up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstreams[name])
            else:
                # Small kernel buffers on both of the proxy's sockets: the link's queue is the buffer.
                up = socket.socket()
                up.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 32 * 1024)
                up.setblocking(False)
                await self.loop.sock_connect(up, ("127.0.0.1", self.upstreams[name]))
                up_reader, up_writer = await asyncio.open_connection(sock=up)
                writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 32 * 1024)
        except OSError:
            writer.transport.abort()
            return
        pair = (writer, up_writer)
        self.conns[name].add(pair)
        pump = self._pump if link is None else self._shaped
        try:
            await asyncio.gather(pump(name, reader, up_writer), pump(name, up_reader, writer))
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

    async def _shaped(self, name: str, reader, writer) -> None:
        """One direction of a shaped link: each chunk leaves once the link has carried the ones before
        it (bandwidth), and arrives ``latency`` later; at most ``in_flight`` bytes are on the link."""
        link = self.links[name]
        queue: asyncio.Queue = asyncio.Queue()
        room = asyncio.Semaphore(max(1, link.in_flight // CHUNK))

        async def deliver():
            try:
                while (item := await queue.get()) is not None:
                    due, data = item
                    await asyncio.sleep(max(0.0, due - time.monotonic()))
                    await self.stalled[name].wait()
                    writer.write(data)
                    await writer.drain()
                    room.release()
            except (OSError, asyncio.CancelledError):
                pass
            finally:
                writer.transport.abort()

        sender = asyncio.ensure_future(deliver())
        free_at = time.monotonic()
        try:
            while True:
                await room.acquire()
                data = await reader.read(CHUNK)
                if not data:
                    break
                now = time.monotonic()
                free_at = max(free_at, now) + (len(data) * 8 / link.bits_per_s if link.bits_per_s else 0.0)
                queue.put_nowait((free_at + link.latency, data))
        except (OSError, asyncio.CancelledError):
            pass
        queue.put_nowait(None)
        await sender

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
            for pairs in self.conns.values():
                for pair in list(pairs):
                    for w in pair:
                        w.transport.abort()
            self.loop.stop()
        self.loop.call_soon_threadsafe(stop)
        self.thread.join(10)


async def _as_coro(fn):
    return fn()


WAN = Link(bits_per_s=1_000_000, latency=0.1)  # a long report tailed from a hotel or over a VPN (issue 33)
