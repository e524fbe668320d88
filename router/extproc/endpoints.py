"""Workers as the endpoint picker protocol names them: `ip:port`.

Envoy's ORIGINAL_DST cluster dials the address in `x-gateway-destination-endpoint` as it is,
so it must be an IP literal. A worker registered under a host name (`http://vllm-0:8000`) is
resolved, and resolved again once its answer is `ttl_s` old: a pod rescheduled under the same
name gets a new IP, and the old one (soon another pod's) must stop receiving prompts
(trust-review L4). One that does not resolve is not offered (and asked again after the TTL).
The book holds at most `max_entries` names and endpoints, least recently used first out, so
registrations that come and go cannot grow it.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TypeVar
from urllib.parse import urlsplit

from router.membership.workers import WorkerId, WorkerState

__all__ = ["EndpointBook", "endpoint_of_url", "RESOLVE_TTL_S", "MAX_ENTRIES"]

RESOLVE_TTL_S = 30.0
"""How long a host name's address is used before it is resolved again."""
MAX_ENTRIES = 4096
"""Names (and endpoints) the book keeps."""
_V = TypeVar("_V")


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
    """Worker id <-> `ip:port`, host names resolved again every `ttl_s`."""

    def __init__(self, *, ttl_s: float = RESOLVE_TTL_S, max_entries: int = MAX_ENTRIES,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._clock = clock
        # url -> (endpoint or None, when it expires; inf for an IP literal)
        self._resolved: OrderedDict[str, tuple[str | None, float]] = OrderedDict()
        self._by_endpoint: OrderedDict[str, WorkerId] = OrderedDict()

    def __len__(self) -> int:
        return len(self._resolved)

    async def endpoint(self, state: WorkerState) -> str | None:
        url = state.info.url
        now = self._clock()
        entry = self._resolved.get(url)
        if entry is None or entry[1] <= now:
            found, literal = await _resolve(url)
            if entry is not None and entry[0] is not None and entry[0] != found \
                    and self._by_endpoint.get(entry[0]) == state.worker_id:
                del self._by_endpoint[entry[0]]  # the name moved: its old IP is not this one
            entry = (found, float("inf") if literal else now + self.ttl_s)
            self._resolved[url] = entry
            _trim(self._resolved, self.max_entries)
        self._resolved.move_to_end(url)
        found = entry[0]
        if found is not None:
            self._by_endpoint[found] = state.worker_id
            self._by_endpoint.move_to_end(found)
            _trim(self._by_endpoint, self.max_entries)
        return found

    def worker(self, endpoint: str) -> WorkerId | None:
        return self._by_endpoint.get(endpoint.strip())


def _trim(entries: OrderedDict[str, _V], limit: int) -> None:
    while len(entries) > limit:
        entries.popitem(last=False)


async def _resolve(url: str) -> tuple[str | None, bool]:
    """(the endpoint, whether the URL names an IP literal: then it never changes)."""
    hostport = endpoint_of_url(url)
    if hostport is None:
        return None, True
    host, port = hostport
    literal = _literal(host, port)
    if literal is not None:
        return literal, True
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        return None, False
    for family, _, _, _, address in infos:
        if family in (socket.AF_INET, socket.AF_INET6):
            return _literal(str(address[0]), port), False
    return None, False
