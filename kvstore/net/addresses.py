"""Host names and IP literals as the daemons, their clients and the router check them.

`is_loopback` decides where a component may run without credentials (a daemon without a token
file, a router without API keys, an etcd password over plain http, an unsigned daemon
registration): one definition, so that every such check agrees on what loopback is.
"""

from __future__ import annotations

import ipaddress

__all__ = ["IPAddress", "ip_literal", "is_loopback"]

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


def ip_literal(host: str) -> IPAddress | None:
    """`host` as an IP address if it is one (brackets allowed; an IPv4-mapped IPv6 address as
    its IPv4 address), else None: a name, never resolved here."""
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def is_loopback(host: str) -> bool:
    """Whether `host` (a listen address or name, without a port) is this machine's loopback."""
    if host.lower() == "localhost":
        return True
    address = ip_literal(host)
    return address is not None and address.is_loopback
