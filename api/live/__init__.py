"""Following a response's events: replay the log, then live, never a seq twice, always to the end.

Each api process has one ``Hub`` (docs/architecture.md, invariants 9 and 12): one Redis
subscription and one fan-out thread that runs every follower of the process. The package, one thing
a module:

* ``frames``: what is written: a batch's SSE chunk or WebSocket frames, encoded once for every
  follower at the same point; the goodbyes (an ``error`` event, the shutdown note);
* ``websocket``: one handed-over WebSocket's protocol after its 101 (``wsproto``): pings, pongs,
  the close handshake, protocol errors, floods;
* ``sinks``: where a follower's frames go: the client's own socket, written without blocking by the
  fan-out thread (``SocketSink``), or a queue a request thread reads (``QueueSink``);
* ``follower``: a client's position in a response's events and its states (REPLAY, LIVE, GAP,
  ENDED), going at its reader's pace; a ``Watcher`` (a long poll waiting for a change);
* ``reads``: the database reads (replays, gaps, polls, "has it ended", token rechecks), on a few
  reader threads, never on the fan-out thread;
* ``topics``: a ``Topic`` per followed response, and the Redis ``Listener``; while Redis is away
  each followed response's log is read every ``poll_interval_seconds``, once for all its followers;
* ``loop``: the fan-out thread: its selector, the calls other threads hand it, its clock;
* ``hub``: the ``Hub`` that ties them, and ``follow`` for a request thread.

A follower costs a few KiB and no thread. It goes at its reader's pace: a replay's next page is read
once less than half of ``follower_buffer_bytes`` is unsent, and a follower past that bound takes no
live batch but reads the log page by page until it has caught up; only a client that takes nothing
for ``follower_stall_seconds`` is cut (it resumes from the log with Last-Event-ID).
"""

from api.live.follower import Follower, Watcher
from api.live.frames import SHUTDOWN_NOTE, Batch, stream_error, ws_accept
from api.live.hub import Hub, ShuttingDown, fd_budget, follow, shutdown_all
from api.live.reads import PAGE

__all__ = ["PAGE", "SHUTDOWN_NOTE", "Batch", "Follower", "Hub", "ShuttingDown", "Watcher", "fd_budget", "follow",
           "shutdown_all", "stream_error", "ws_accept"]
