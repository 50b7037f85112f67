"""A loopback TCP proxy that can cut a real server off and bring it back.

`weed mini` does not come back on the same port after a restart here, so tests of
recovery put this in front of it instead: `cut()` drops every open connection and
resets new ones (what clients see of a dead server), `restore()` forwards again.
`bytes_per_second` caps what all its connections together carry (both directions share
one budget), as a throttled bucket or a far link would.
"""

from __future__ import annotations

import socket
import threading
import time


class TcpProxy:
    def __init__(self, target_port: int, host: str = "127.0.0.1", bytes_per_second: float | None = None):
        self.target = (host, target_port)
        self.bytes_per_second = bytes_per_second
        self._next_free = 0.0  # when the capped link is free again (monotonic)
        self._listener = socket.create_server((host, 0))
        self.port = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []
        self._cut = False
        self._closed = False
        self._accepter = threading.Thread(target=self._accept, name="tcp-proxy-accept", daemon=True)
        self._accepter.start()

    @property
    def endpoint_url(self) -> str:
        return f"http://{self.target[0]}:{self.port}"

    def cut(self) -> None:
        with self._lock:
            self._cut = True
            doomed, self._open = self._open, set()
        for sock in doomed:
            _close(sock)

    def restore(self) -> None:
        with self._lock:
            self._cut = False

    def close(self) -> None:
        self._closed = True
        self.cut()
        _close(self._listener)
        self._accepter.join(timeout=5)
        for thread in self._threads:
            thread.join(timeout=5)

    def __enter__(self) -> "TcpProxy":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                if self._cut:
                    client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                    _close(client)  # reset: nobody home
                    continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
                upstream.settimeout(None)
            except OSError:
                _close(client)
                continue
            with self._lock:
                self._open |= {client, upstream}
            for source, sink in ((client, upstream), (upstream, client)):
                thread = threading.Thread(target=self._pump, args=(source, sink), name="tcp-proxy-pump", daemon=True)
                self._threads.append(thread)
                thread.start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(1 << 20 if self.bytes_per_second is None else 1 << 14):
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
        """Hold this pump until the link would have carried `nbytes` at the cap (no burst credit)."""
        with self._lock:
            now = time.monotonic()
            self._next_free = max(now, self._next_free) + nbytes / self.bytes_per_second
            wait = self._next_free - now
        if wait > 0:
            time.sleep(wait)  # throttling, not synchronisation


def _close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
