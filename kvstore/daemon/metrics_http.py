"""The daemon's `/metrics` endpoint: Prometheus text over HTTP, on a port of its own.

`--metrics-listen` says where: `auto` (the `--listen` host, any free port; logged), `off`, or
HOST:PORT (what a deployment gives, so that Prometheus knows where to scrape). Like the daemon's
other listeners it binds loopback only unless a token file is configured (the series name
tiers, peers and tenants' traffic, not data); with `--tls-cert` it serves HTTPS with the same
certificate. prometheus_client's own server runs it on one thread of its own, away from the
daemon's event loop and I/O threads, so a slow scrape never delays a block.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server

from kvstore.errors import ConfigError

__all__ = ["MetricsEndpoint"]

_log = logging.getLogger(__name__)


class MetricsEndpoint:
    """`/metrics` of one registry on HOST:PORT (port 0: any free port); `start()`, `stop()`."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int, *,
                 tls_cert: Path | None = None, tls_key: Path | None = None) -> None:
        self._registry = registry
        self._bind = (host, port)
        self._tls = (tls_cert, tls_key) if tls_cert is not None and tls_key is not None else None
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None
        self.port = 0

    @property
    def url(self) -> str:
        host = self._bind[0]
        shown = f"[{host}]" if ":" in host else host
        return f"{'https' if self._tls else 'http'}://{shown}:{self.port}/metrics"

    def start(self) -> int:
        """Bind and serve; returns the bound port. ConfigError if the address is taken."""
        host, port = self._bind
        cert, key = self._tls if self._tls else (None, None)
        try:
            self._server, self._thread = start_http_server(
                port, addr=host, registry=self._registry,
                certfile=str(cert) if cert else None, keyfile=str(key) if key else None)
        except OSError as exc:
            raise ConfigError(f"cannot serve metrics on {host}:{port}: {exc}") from exc
        self.port = int(self._server.server_address[1])
        return self.port

    def stop(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        if self._thread is not None:
            self._thread.join(5.0)
