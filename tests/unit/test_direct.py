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
