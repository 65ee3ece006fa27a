"""A TCP proxy on loopback that a test can cut and restore: an outage of one link.

Outage tests used to stop the session's shared nats-server or Postgres, which every other
test also uses; a proxy in front of the server fakes the outage for the clients that go
through it alone. `cut()` closes every connection through the proxy and refuses new ones
(each is accepted and closed at once, which a client sees as a server that hung up);
`restore()` lets connections through again. The server itself never notices.

It runs on threads of its own, not on an event loop, so clients on any loop, in threads
or in child processes behave alike. (The benchmark's delaying proxy,
`buffered_store.benchmarks.proxy`, is a separate process that adds latency and cannot
be cut; this one adds none.)
"""

from __future__ import annotations

import contextlib
import socket
import threading
from types import TracebackType
from urllib.parse import urlsplit, urlunsplit

__all__ = ["CuttableProxy", "url_via"]

_CHUNK = 65536


def url_via(url: str, host: str, port: int) -> str:
    """`url` (any scheme: nats://, postgresql://, postgresql+psycopg://) reaching
    `host:port` instead, with its credentials, path and query kept."""
    parts = urlsplit(url)
    auth, _, _ = parts.netloc.rpartition("@")
    netloc = f"{auth}@{host}:{port}" if auth else f"{host}:{port}"
    return urlunsplit(parts._replace(netloc=netloc))


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.close()


class CuttableProxy:
    """Forwards 127.0.0.1:`port` to `target_host:target_port` until `cut()`.

    Usage::

        with CuttableProxy("127.0.0.1", 5432) as link:
            store = await connect(link.via(database_url))
            link.cut()      # the store's connections drop; reconnects are hung up on
            link.restore()  # reconnects get through again
    """

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self._listener: socket.socket | None = None
        self._accepting: threading.Thread | None = None
        self._lock = threading.Lock()
        self._pairs: set[tuple[socket.socket, socket.socket]] = set()
        self._cut = False
        self._closed = threading.Event()
        self.connections = 0
        """Connections forwarded so far (refused ones while cut are not counted)."""
        self.refused = 0
        """Connections hung up on while the link was cut."""

    @classmethod
    def in_front_of(cls, url: str) -> CuttableProxy:
        """A proxy (not started) in front of the server `url` names."""
        parts = urlsplit(url)
        if parts.hostname is None or parts.port is None:
            raise ValueError(f"{url!r} names no host and port")
        return cls(parts.hostname, parts.port)

    @property
    def port(self) -> int:
        """The loopback port clients connect to."""
        if self._listener is None:
            raise RuntimeError("the proxy is not started")
        return int(self._listener.getsockname()[1])

    @property
    def is_cut(self) -> bool:
        """Whether the link is cut right now."""
        return self._cut

    def via(self, url: str) -> str:
        """`url` going through this proxy."""
        return url_via(url, "127.0.0.1", self.port)

    def start(self) -> CuttableProxy:
        """Listen on a free loopback port and forward from now on."""
        listener = socket.create_server(("127.0.0.1", 0))
        listener.settimeout(0.1)
        self._listener = listener
        self._accepting = threading.Thread(target=self._accept, name="proxy-accept", daemon=True)
        self._accepting.start()
        return self

    def cut(self) -> None:
        """Drop every open connection and hang up on new ones until `restore()`."""
        with self._lock:
            self._cut = True
            pairs, self._pairs = self._pairs, set()
        for client, upstream in pairs:
            _close(client)
            _close(upstream)

    def restore(self) -> None:
        """Forward new connections again (the dropped ones stay dropped)."""
        with self._lock:
            self._cut = False

    def close(self) -> None:
        """Stop listening and drop every connection."""
        self._closed.set()
        self.cut()
        if self._accepting is not None:
            self._accepting.join(timeout=5)
        if self._listener is not None:
            _close(self._listener)

    def __enter__(self) -> CuttableProxy:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _accept(self) -> None:
        assert self._listener is not None
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            if self._cut:
                self.refused += 1
                _close(client)
                continue
            threading.Thread(target=self._forward, args=(client,), daemon=True).start()

    def _forward(self, client: socket.socket) -> None:
        client.settimeout(None)
        try:
            upstream = socket.create_connection(self.target, timeout=10)
        except OSError:
            _close(client)
            return
        upstream.settimeout(None)
        for sock in (client, upstream):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        pair = (client, upstream)
        with self._lock:
            # The link may have been cut while this connection was being opened.
            if self._cut:
                _close(client)
                _close(upstream)
                return
            self._pairs.add(pair)
            self.connections += 1
        back = threading.Thread(target=self._pipe, args=(upstream, client), daemon=True)
        back.start()
        self._pipe(client, upstream)
        back.join()
        with self._lock:
            self._pairs.discard(pair)
        _close(client)
        _close(upstream)

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        """Copy one direction until either side closes."""
        try:
            while data := src.recv(_CHUNK):
                dst.sendall(data)
        except OSError:
            pass
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)
