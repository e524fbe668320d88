"""A slow network path (tests, benchmarks): a loopback TCP proxy that delivers what its client
sends `delay_s` late (replies come back at once), and that can be cut like the link of a dead
node.

A worker whose daemons sit behind one sees every call to them take `delay_s` longer, so the
write-behind of a block lags its computation by a known margin; `sever()` drops the bytes still
in the link (those a node that just died had not got out yet) and closes every connection.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections import deque
from collections.abc import Iterator

__all__ = ["SlowLink", "slow_links"]


class _Pipe:
    """One proxied connection: client -> upstream delayed, upstream -> client direct."""

    def __init__(self, client: socket.socket, upstream: socket.socket, delay_s: float) -> None:
        self.client = client
        self.upstream = upstream
        self._delay = delay_s
        self._queue: deque[tuple[float, bytes]] = deque()
        self._ready = threading.Condition()
        self._closed = False
        for target in (self._read_client, self._deliver, self._read_upstream):
            threading.Thread(target=target, daemon=True).start()

    def close(self) -> None:
        with self._ready:
            self._closed = True
            self._queue.clear()
            self._ready.notify_all()
        for sock in (self.client, self.upstream):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def _read_client(self) -> None:
        while True:
            try:
                data = self.client.recv(1 << 16)
            except OSError:
                data = b""
            with self._ready:
                if self._closed:
                    return
                # Empty data is the client's end of stream: delivered late like the rest.
                self._queue.append((time.monotonic() + self._delay, data))
                self._ready.notify_all()
            if not data:
                return

    def _deliver(self) -> None:
        while True:
            with self._ready:
                while not self._queue and not self._closed:
                    self._ready.wait()
                if self._closed:
                    return
                due, data = self._queue[0]
                wait = due - time.monotonic()
                if wait > 0:
                    self._ready.wait(wait)
                    continue
                self._queue.popleft()
            try:
                if data:
                    self.upstream.sendall(data)
                else:
                    self.upstream.shutdown(socket.SHUT_WR)
                    return
            except OSError:
                return

    def _read_upstream(self) -> None:
        while True:
            try:
                data = self.upstream.recv(1 << 16)
                if not data:
                    self.client.shutdown(socket.SHUT_WR)
                    return
                self.client.sendall(data)
            except OSError:
                return


class SlowLink:
    """Listens on a free loopback port and forwards every connection to `upstream`
    (host:port), delaying the client's bytes by `delay_s`."""

    def __init__(self, upstream: str, delay_s: float) -> None:
        host, port = upstream.rsplit(":", 1)
        self._upstream = (host, int(port))
        self._delay = delay_s
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._pipes: list[_Pipe] = []
        self._lock = threading.Lock()
        self._severed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def sever(self) -> None:
        """Cut the link: undelivered bytes are lost, every connection and the listener close."""
        with self._lock:
            self._severed = True
            pipes, self._pipes = self._pipes, []
        self._listener.close()
        for pipe in pipes:
            pipe.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self._upstream, timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            for sock in (client, upstream):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                if self._severed:
                    client.close()
                    upstream.close()
                    return
                self._pipes.append(_Pipe(client, upstream, self._delay))


@contextlib.contextmanager
def slow_links(upstreams: dict[str, str], delay_s: float) -> Iterator[dict[str, SlowLink]]:
    """One `SlowLink` per named upstream; all severed at the end."""
    links = {name: SlowLink(address, delay_s) for name, address in upstreams.items()}
    try:
        yield links
    finally:
        for link in links.values():
            link.sever()
