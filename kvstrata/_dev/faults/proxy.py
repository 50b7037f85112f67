"""A loopback TCP proxy in front of an S3 server that can misbehave on demand.

Modes, switched at any time (`set_mode`):
- ``forward``: pass bytes both ways (optionally capped at `bytes_per_second`, which all
  connections and both directions share, as a throttled bucket or a far link would);
- ``refuse``: reset every connection (a server that is down);
- ``blackhole``: accept and read, never answer, and stop forwarding on open
  connections (a server or network that went silent);
- ``slowdown``: answer every new request ``503 SlowDown`` with S3's XML error body and
  close (a throttled bucket), and drop open connections.

Each connection's pumps are threads the proxy owns and joins at `close`.
"""

from __future__ import annotations

import socket
import threading
import time

MODES = ("forward", "refuse", "blackhole", "slowdown")

_SLOWDOWN = (
    b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s"
)
_SLOWDOWN_BODY = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)


class FaultProxy:
    """Forwards 127.0.0.1:`port` to `target_port`, or fails the way `mode` says."""

    def __init__(self, target_port: int, host: str = "127.0.0.1", bytes_per_second: float | None = None):
        self.target = (host, target_port)
        self.bytes_per_second = bytes_per_second
        self._listener = socket.create_server((host, 0))
        self.port = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []
        self._mode = "forward"
        self._next_free = 0.0  # when the capped link is free again (monotonic)
        self._closed = False
        self.answered_503 = 0
        self._accepter = threading.Thread(target=self._accept, name="fault-proxy-accept", daemon=True)
        self._accepter.start()

    @property
    def endpoint_url(self) -> str:
        return f"http://{self.target[0]}:{self.port}"

    @property
    def mode(self) -> str:
        return self._mode

    def set_mode(self, mode: str, bytes_per_second: float | None = None) -> None:
        """Switch behaviour; every mode but ``forward`` also drops the open connections."""
        if mode not in MODES:
            raise ValueError(f"proxy mode {mode!r} is not one of {MODES}")
        with self._lock:
            self._mode = mode
            self.bytes_per_second = bytes_per_second
            doomed = set() if mode == "forward" else self._open
            if doomed:
                self._open = set()
        for sock in doomed:
            _close(sock)

    def close(self) -> None:
        self._closed = True
        self.set_mode("refuse")
        _close(self._listener)
        self._accepter.join(timeout=5)
        for thread in self._threads:
            thread.join(timeout=5)

    def __enter__(self) -> "FaultProxy":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _start(self, target, *args) -> None:
        thread = threading.Thread(target=target, args=args, name="fault-proxy-pump", daemon=True)
        self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        thread.start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            mode = self._mode
            if mode == "refuse":
                client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                _close(client)
            elif mode == "slowdown":
                self._start(self._answer_slowdown, client)
            elif mode == "blackhole":
                with self._lock:
                    self._open.add(client)
                self._start(self._swallow, client)
            else:
                self._connect(client)

    def _connect(self, client: socket.socket) -> None:
        try:
            upstream = socket.create_connection(self.target, timeout=5)
            upstream.settimeout(None)
        except OSError:
            _close(client)
            return
        with self._lock:
            self._open |= {client, upstream}
        self._start(self._pump, client, upstream)
        self._start(self._pump, upstream, client)

    def _answer_slowdown(self, client: socket.socket) -> None:
        try:
            client.settimeout(5)
            client.recv(65536)  # the request line and headers; the body is never read
            client.sendall(_SLOWDOWN % (len(_SLOWDOWN_BODY), _SLOWDOWN_BODY))
            with self._lock:
                self.answered_503 += 1
        except OSError:
            pass
        finally:
            _close(client)

    def _swallow(self, client: socket.socket) -> None:
        try:
            while not self._closed and self._mode == "blackhole" and client.recv(1 << 16):
                pass
        except OSError:
            pass
        finally:
            with self._lock:
                self._open.discard(client)
            _close(client)

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(1 << 20 if self.bytes_per_second is None else 1 << 14):
                if self._mode == "blackhole":
                    break
                sink.sendall(data)
                if self.bytes_per_second is not None:
                    self._pace(len(data))
        except OSError:
            pass
        finally:
            with self._lock:
                self._open -= {source, sink}
            _close(source)
            _close(sink)

    def _pace(self, nbytes: int) -> None:
        """Hold this pump until the link would have carried `nbytes` at the cap: one budget
        for every connection and both directions, no burst credit."""
        with self._lock:
            rate = self.bytes_per_second
            if not rate:
                return
            now = time.monotonic()
            self._next_free = max(now, self._next_free) + nbytes / rate
            wait = self._next_free - now
        if wait > 0:
            time.sleep(wait)  # throttling, not synchronisation


def _close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
