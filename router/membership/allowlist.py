"""Which worker addresses the router may send prompts to and read KV events from.

A worker registration (JSON under the workers prefix in etcd) is a claim, not a fact: anyone who
can write there could otherwise point the router at any URL, and the router would forward
prompts to it and show the answer to the client (server-side request forgery). So a
registration is believed only if its URL matches an entry of the allow-list, and its KV-event
endpoint is subscribed to only if that endpoint's host does; others are ignored and counted.

Entries (`--allow-workers` or `workers.allow` in the config file), each with an optional
port or port range after the host:

    10.0.0.0/8   10.8.3.17   10.0.0.0/8:8000-8100   [fd00::1]:8000   fd00::/8
    vllm-0.vllm.svc:8000   *.vllm.svc.cluster.local   *:8000   *

Addresses match IP literals in URLs (an IPv4-mapped IPv6 address as its IPv4 address); names
match names, exactly or by a `*.` suffix. A name is never resolved to be checked against an
address range: its DNS answer could change after the check. Numeric host forms other than the
canonical ones (`2130706433`, `0x7f.1`, which the resolver reads as addresses) are refused.
KV-event endpoints must be `tcp://HOST:PORT` and are matched by host only (a worker's event
port is not its HTTP port). With no entries the router allows loopback only (127.0.0.0/8, ::1,
`localhost`), as the kvstore daemon serves loopback only without a token file.

An entry may be bound to one worker id, `ID=HOST[:PORTS]` (`w1=10.8.3.17:8000`,
`vllm-0=vllm-0.vllm.svc:8000`): that id is then believed only at what its own entries match,
whatever the other entries allow, and its entries allow no other id. This is the proof a
registration needs beyond its lease (trust review H2): an etcd writer who overwrites `w1`'s
record with another URL, even under a lease of their own, is refused, where otherwise the
forgery would be believed until w1's agent wrote its record back (at most TTL/3 later).
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable
from dataclasses import dataclass, replace
from urllib.parse import urlsplit

from kvstore.errors import ConfigError
from kvstore.net.addresses import ip_literal, is_loopback

__all__ = ["AllowEntry", "WorkerAllowList", "is_loopback"]

_Network = ipaddress.IPv4Network | ipaddress.IPv6Network
_LABEL = re.compile(r"[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?")
_NUMERIC_LABEL = re.compile(r"(0x[0-9a-f]*|[0-9]+)")
_DEFAULT_PORTS = {"http": 80, "https": 443}


def _valid_name(host: str) -> bool:
    labels = host.split(".")
    if not all(_LABEL.fullmatch(label) for label in labels):
        return False
    # What the resolver would read as an address (inet_aton's forms) is not a name.
    return not all(_NUMERIC_LABEL.fullmatch(label) for label in labels)


@dataclass(frozen=True, slots=True)
class AllowEntry:
    """One allow-list entry: an address range, a name (`suffix` for `*.name`), or any host
    (`*`), with an inclusive port range (None: any port)."""

    text: str
    network: _Network | None = None
    name: str | None = None
    suffix: bool = False
    ports: tuple[int, int] | None = None
    worker: str | None = None
    """The one worker id this entry allows (`ID=HOST[:PORTS]`); None: any id."""

    @classmethod
    def parse(cls, text: str) -> AllowEntry:
        worker, sep, rest = text.strip().partition("=")
        if sep:
            if not worker or any(c.isspace() or c == "/" for c in worker):
                raise ConfigError(f"worker allow-list entry {text!r}: bad worker id")
            return replace(cls.parse(rest), text=text.strip(), worker=worker)
        spec = text.strip().lower()
        host, ports = _split_ports(spec, text)
        if not host:
            raise ConfigError(f"worker allow-list entry {text!r} names no host")
        if host == "*":
            return cls(text.strip(), ports=ports)
        try:
            network = ipaddress.ip_network(host, strict=False)
        except ValueError:
            pass
        else:
            return cls(text.strip(), network=network, ports=ports)
        suffix = host.startswith("*.")
        name = host[2:] if suffix else host
        if not _valid_name(name):
            raise ConfigError(f"worker allow-list entry {text!r}: not an address, a network "
                              "or a host name")
        return cls(text.strip(), name=name, suffix=suffix, ports=ports)

    def matches_host(self, host: str) -> bool:
        address = ip_literal(host)
        if self.network is not None:
            return address is not None and address.version == self.network.version \
                and address in self.network
        if self.name is None:  # `*`
            return True
        if address is not None:
            return False
        host = host.lower().rstrip(".")
        if self.suffix:
            return host.endswith("." + self.name)
        return host == self.name

    def matches(self, host: str, port: int) -> bool:
        if self.ports is not None and not self.ports[0] <= port <= self.ports[1]:
            return False
        return self.matches_host(host)


def _split_ports(spec: str, text: str) -> tuple[str, tuple[int, int] | None]:
    if spec.startswith("["):
        host, sep, rest = spec[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise ConfigError(f"worker allow-list entry {text!r}: bad bracketed address")
        return host, _ports(rest[1:], text) if rest else None
    if spec.count(":") == 1:  # host:ports (an IPv6 address has more colons, and no port)
        host, _, ports = spec.partition(":")
        return host, _ports(ports, text)
    return spec, None


def _ports(spec: str, text: str) -> tuple[int, int]:
    low, sep, high = spec.partition("-")
    try:
        first, last = int(low), int(high) if sep else int(low)
    except ValueError:
        raise ConfigError(f"worker allow-list entry {text!r}: bad port {spec!r}") from None
    if not 0 < first <= last < 65536:
        raise ConfigError(f"worker allow-list entry {text!r}: ports must be in 1-65535, low "
                          "to high")
    return first, last


_LOOPBACK = (AllowEntry.parse("127.0.0.0/8"), AllowEntry.parse("::1"),
             AllowEntry.parse("localhost"))


@dataclass(frozen=True, slots=True)
class WorkerAllowList:
    """The entries a worker URL or KV-event endpoint must match. `configured` False: the
    loopback-only default."""

    entries: tuple[AllowEntry, ...] = _LOOPBACK
    configured: bool = False

    @classmethod
    def parse(cls, specs: Iterable[str]) -> WorkerAllowList:
        """From `--allow-workers` / `workers.allow` entries (each may be comma-separated);
        none: loopback only."""
        entries = tuple(AllowEntry.parse(part) for spec in specs
                        for part in spec.split(",") if part.strip())
        return cls(entries, True) if entries else cls()

    def with_urls(self, urls: Iterable[str]) -> WorkerAllowList:
        """This list plus exactly the host and port of each of `urls` (workers, and their
        `tcp://` KV-event endpoints, an operator named on the command line are allowed as
        named)."""
        extra: list[AllowEntry] = []
        for url in urls:
            try:
                parts = urlsplit(url)
                parts.port  # noqa: B018 - raises on a malformed port
            except ValueError:
                continue
            if parts.hostname and parts.hostname != "*":
                port = parts.port or _DEFAULT_PORTS.get(parts.scheme, 80)
                host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
                extra.append(AllowEntry.parse(f"{host}:{port}"))
        return WorkerAllowList(self.entries + tuple(extra), self.configured)

    def describe(self) -> str:
        return ", ".join(e.text for e in self.entries)

    def _entries_for(self, worker_id: str | None) -> tuple[AllowEntry, ...]:
        """The entries that may allow `worker_id`: its own if it has any (then nothing else
        does), else the unbound ones (None: every entry, for callers without an id)."""
        if worker_id is None:
            return self.entries
        own = tuple(e for e in self.entries if e.worker == worker_id)
        return own or tuple(e for e in self.entries if e.worker is None)

    def url_refusal(self, url: str, worker_id: str | None = None) -> str | None:
        """Why a worker URL may not be forwarded to, or None when it may; `worker_id`: the id
        registered with it (entries bound to ids apply to their id only)."""
        try:
            parts = urlsplit(url)
            port = parts.port
        except ValueError as exc:
            return f"unparsable URL ({exc})"
        if parts.scheme not in _DEFAULT_PORTS:
            return f"scheme {parts.scheme!r} is not http or https"
        if parts.username is not None or parts.password is not None:
            return "URL carries credentials"
        if parts.query or parts.fragment:
            return "URL carries a query or fragment"
        host = parts.hostname
        if not host:
            return "URL names no host"
        if ip_literal(host) is None and not _valid_name(host.rstrip(".")):
            return f"host {host!r} is neither a canonical address nor a name"
        port = port or _DEFAULT_PORTS[parts.scheme]
        if not any(e.matches(host, port) for e in self._entries_for(worker_id)):
            who = "" if worker_id is None else f" for worker {worker_id}"
            return f"{host}:{port} is not in the worker allow-list{who} ({self.describe()})"
        return None

    def events_refusal(self, endpoint: str, worker_id: str | None = None) -> str | None:
        """Why a KV-event endpoint may not be subscribed to, or None when it may."""
        scheme, sep, rest = endpoint.partition("://")
        if not sep or scheme != "tcp":
            return f"KV-event endpoint {endpoint!r} is not tcp://HOST:PORT"
        if ";" in rest:  # ZMQ's source-address form
            return f"KV-event endpoint {endpoint!r} names a source address"
        host, sep, port = rest.rpartition(":")
        host = host.strip("[]")
        if not sep or not port.isdigit() or not host or host == "*":
            return f"KV-event endpoint {endpoint!r} is not tcp://HOST:PORT"
        if ip_literal(host) is None and not _valid_name(host.lower().rstrip(".")):
            return f"KV-event host {host!r} is neither a canonical address nor a name"
        if not any(e.matches_host(host) for e in self._entries_for(worker_id)):
            return f"KV-event host {host} is not in the worker allow-list ({self.describe()})"
        return None
