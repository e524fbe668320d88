"""Real listeners that pretend to be kvstore daemons, for the registration-forgery tests: they
record what clients send them (the bearer token must never be in it).

- `GrpcImpostor`: a gRPC server that accepts any call and records its metadata (HTTP/2
  headers are HPACK-compressed on the wire, so only a real server shows them plainly).
- `RawImpostor`: a TCP listener (optionally completing TLS with a certificate it was given)
  that records every byte and counts connections: the data plane's wire, or proof that a
  client dialled at all.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import threading
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc

__all__ = ["GrpcImpostor", "RawImpostor", "non_loopback_ip"]


def non_loopback_ip() -> str | None:
    """An address of this machine other than loopback that a test can listen on, or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.123", 9))  # TEST-NET: nothing is sent, a route is chosen
            address = str(probe.getsockname()[0])
        except OSError:
            return None
    if address.startswith("127.") or address == "0.0.0.0":
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((address, 0))
        except OSError:
            return None
    return address


class _Recorder(grpc.GenericRpcHandler):  # type: ignore[misc]
    def __init__(self, impostor: GrpcImpostor) -> None:
        self._impostor = impostor

    def service(self, handler_call_details: Any) -> None:
        with self._impostor.lock:
            self._impostor.calls.append((handler_call_details.method,
                                         tuple(handler_call_details.invocation_metadata)))
        # UNIMPLEMENTED: the client has already sent its headers by now


class GrpcImpostor:
    def __init__(self, host: str = "127.0.0.1") -> None:
        self.lock = threading.Lock()
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self._server = grpc.server(futures.ThreadPoolExecutor(2))
        self._server.add_generic_rpc_handlers((_Recorder(self),))
        self.port = self._server.add_insecure_port(f"{host}:0")
        self.address = f"{host}:{self.port}"
        self._server.start()

    def seen(self) -> str:
        """Everything the clients sent in metadata, as one string."""
        with self.lock:
            return " ".join(f"{m} {k}={v}" for m, md in self.calls for k, v in md)

    def close(self) -> None:
        self._server.stop(0)


class RawImpostor:
    def __init__(self, host: str = "127.0.0.1", *, cert: Path | None = None,
                 key: Path | None = None) -> None:
        self.lock = threading.Lock()
        self.received = bytearray()
        self.connections = 0
        self._context: ssl.SSLContext | None = None
        if cert is not None and key is not None:
            self._context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            self._context.load_cert_chain(cert, key)
            self._context.set_alpn_protocols(["h2"])  # what a gRPC client asks for
        self._sock = socket.create_server((host, 0))
        self.port = int(self._sock.getsockname()[1])
        self.address = f"{host}:{self.port}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        self._sock.settimeout(0.2)
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with self.lock:
                self.connections += 1
            threading.Thread(target=self._read, args=(conn,), daemon=True).start()

    def _read(self, conn: socket.socket) -> None:
        with contextlib.suppress(OSError, ssl.SSLError):
            conn.settimeout(5.0)
            if self._context is not None:
                conn = self._context.wrap_socket(conn, server_side=True)
            while not self._stop.is_set():
                data = conn.recv(65536)
                if not data:
                    break
                with self.lock:
                    self.received += data
        with contextlib.suppress(OSError):
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._sock.close()
        self._thread.join(2)
