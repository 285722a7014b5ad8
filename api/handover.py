"""Handing a client's socket from the WSGI server to the process's fan-out thread (api/live/).

``api.serve.Worker`` (gunicorn gthread) offers ``environ[DETACH]``: a view's ``Handover`` response
writes its head on the socket, hands the socket on, and tells gunicorn the request is over without
closing the socket or reading another request from it. Elsewhere (the Flask test client, TLS or
HTTP/2) there is no DETACH, and an event stream holds its request thread as before.
"""

from collections.abc import Callable

from flask import Response, g

DETACH = "lmsp.detach"  # environ: a function taking the request's socket off the server's hands


def client_socket(environ):
    """The request's socket when it can be handed over: gunicorn's under ``api.serve.Worker``, or a
    socket a caller put in ``werkzeug.socket`` (the unit tests' socket pairs); else None."""
    if DETACH in environ:
        return environ.get("gunicorn.socket")
    return environ.get("werkzeug.socket")


def can_detach(environ) -> bool:
    return client_socket(environ) is not None


def chunked(environ) -> bool:
    """Whether a handed-over stream's body is chunked: HTTP/1.0 has no chunked coding, so its body is
    written plain and ends when the connection closes (an HTTP/1.0 proxy, nginx's default upstream
    protocol, is a client of that kind)."""
    return environ.get("SERVER_PROTOCOL") != "HTTP/1.0"


class Handover(Response):
    """A response whose body is written by someone else: ``take(sock)`` gets the socket once the head
    (status and every header the app added, ``Connection: close`` or the 101's upgrade) is sent."""

    def __init__(self, take: Callable, status: int, headers: dict):
        super().__init__(status=status, headers=headers)
        self.take = take
        self.release = g.pop("release_stream", None)  # the follower holds its slot from now on

    def __call__(self, environ, start_response):
        sock = client_socket(environ)
        headers = self.get_wsgi_headers(environ)
        headers.remove("Content-Length")
        if self.status_code == 101:
            headers.remove("Content-Type")  # a switch of protocols has no body to type
        else:
            # One stream a connection; chunked, so a client reading by size gets each frame at once.
            headers["Connection"] = "close"
            if chunked(environ):
                headers["Transfer-Encoding"] = "chunked"
        head = f"HTTP/1.1 {self.status}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.to_wsgi_list())
        try:
            sock.sendall((head + "\r\n").encode("latin-1"))
        except OSError:
            self._release()
            raise StopIteration() from None  # the client is gone: gunicorn closes the socket
        environ.get(DETACH, id)(sock)
        self.take(sock, self._release)
        # gunicorn ends a request whose app raises StopIteration without writing anything (flask-sock
        # does the same for WebSockets); api.serve.Worker then forgets the socket instead of closing it.
        raise StopIteration()

    def _release(self) -> None:
        if self.release is not None:
            self.release()
