"""api/direct.py's ClientWatch: how a request that writes nothing while it waits sees its client leave."""

import socket

from api import direct


def watch(sock) -> direct.ClientWatch:
    w = direct.ClientWatch({"gunicorn.socket": sock})
    w.checked = -1e9  # look now, not after GONE_CHECK_SECONDS
    return w


def test_a_closed_client_is_gone_and_an_open_one_is_not():
    server, client = socket.socketpair()
    try:
        assert not watch(server).gone()  # connected, nothing sent
        client.sendall(b"GET / HTTP/1.1\r\n")  # a pipelined request is not a goodbye, and stays unread
        assert not watch(server).gone() and server.recv(100, socket.MSG_PEEK)
        server.recv(100)
        client.close()
        assert watch(server).gone()
    finally:
        server.close()


def test_looks_at_most_every_interval_and_never_without_a_plain_socket():
    server, client = socket.socketpair()
    try:
        w = direct.ClientWatch({"gunicorn.socket": server})
        assert not w.gone()  # looked: still there
        client.close()
        assert not w.gone()  # within GONE_CHECK_SECONDS of the last look: not looked at again
        w.checked -= direct.GONE_CHECK_SECONDS
        assert w.gone()
        assert not watch(None).gone()  # the Flask test client, TLS: no socket to look at
    finally:
        server.close()


def test_a_watcher_of_a_started_task_is_not_woken_by_its_text():
    """The long poll's watcher (api/live/follower.py Watcher): once its task has started, a batch of
    deltas alone is dropped on the fan-out thread; a state event, or any batch before the start,
    wakes the waiting thread."""
    from api.live.follower import Watcher
    from api.live.frames import Batch
    from api.live.sinks import QueueSink
    from common.events import ITEM_DONE, TEXT_DELTA

    watcher = Watcher(None, "resp_1", QueueSink(lambda fn, *a: fn(*a), None))
    text = Batch([(5, TEXT_DELTA, "{}"), (6, TEXT_DELTA, "{}")])
    watcher.deliver(text)
    assert watcher.get(0.01) == text.events  # not started yet: its first token is news
    watcher.text_wakes = False
    watcher.deliver(text)
    assert watcher.get(0.01) is None
    state = Batch([(7, TEXT_DELTA, "{}"), (8, ITEM_DONE, "{}")])
    watcher.deliver(state)
    assert watcher.get(0.01) == state.events
