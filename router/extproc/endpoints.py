"""Workers as the endpoint picker protocol names them: `ip:port`.

Envoy's ORIGINAL_DST cluster dials the address in `x-gateway-destination-endpoint` as it is,
so it must be an IP literal. A worker registered under a host name (`http://vllm-0:8000`) is
resolved once and cached; one that does not resolve is not offered.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from urllib.parse import urlsplit

from router.workers import WorkerId, WorkerState

__all__ = ["EndpointBook", "endpoint_of_url"]


def endpoint_of_url(url: str) -> tuple[str, int] | None:
    """(host, port) of a worker URL, or None if it has no host."""
    parts = urlsplit(url)
    if not parts.hostname:
        return None
    return parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)


def _literal(host: str, port: int) -> str | None:
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    return f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"


class EndpointBook:
    """Worker id <-> `ip:port`, resolving host names once."""

    def __init__(self) -> None:
        self._resolved: dict[str, str | None] = {}
        self._by_endpoint: dict[str, WorkerId] = {}

    async def endpoint(self, state: WorkerState) -> str | None:
        url = state.info.url
        if url not in self._resolved:
            self._resolved[url] = await _resolve(url)
        found = self._resolved[url]
        if found is not None:
            self._by_endpoint[found] = state.worker_id
        return found

    def worker(self, endpoint: str) -> WorkerId | None:
        return self._by_endpoint.get(endpoint.strip())


async def _resolve(url: str) -> str | None:
    hostport = endpoint_of_url(url)
    if hostport is None:
        return None
    host, port = hostport
    literal = _literal(host, port)
    if literal is not None:
        return literal
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        return None
    for family, _, _, _, address in infos:
        if family in (socket.AF_INET, socket.AF_INET6):
            return _literal(str(address[0]), port)
    return None
