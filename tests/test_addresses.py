"""`kvstore.net.addresses`: the one definition of loopback the daemon's trust, the etcd spec and
the router's allow-list share."""

from __future__ import annotations

import ipaddress

import pytest

from kvstore.cluster.daemon_trust import DaemonTrust
from kvstore.cluster.discovery import DaemonInfo
from kvstore.errors import UntrustedRegistration
from kvstore.net.addresses import ip_literal, is_loopback
from router.membership.allowlist import is_loopback as router_is_loopback


@pytest.mark.parametrize("host", ["127.0.0.1", "127.8.9.10", "::1", "[::1]", "localhost",
                                  "LocalHost", "::ffff:127.0.0.1", "[::ffff:127.0.0.2]"])
def test_loopback_forms(host: str) -> None:
    assert is_loopback(host)


@pytest.mark.parametrize("host", ["10.0.0.1", "0.0.0.0", "::", "fd00::1", "example.com",
                                  "localhost.example.com", "::ffff:10.0.0.1", "", "127.0.0.1:80"])
def test_not_loopback(host: str) -> None:
    assert not is_loopback(host)


def test_ip_literals_and_names() -> None:
    assert ip_literal("[fd00::1]") == ipaddress.ip_address("fd00::1")
    assert ip_literal("::ffff:10.1.2.3") == ipaddress.ip_address("10.1.2.3")
    assert ip_literal("vllm-0.svc") is None


def test_the_router_and_the_daemon_trust_use_the_same_definition() -> None:
    assert router_is_loopback is is_loopback
    # Without keys or TLS a client believes an unsigned registration only on loopback.
    trust = DaemonTrust.of(public_key_file=None, tls=False)
    prefix = b"/kvkeep/daemons/"
    for address in ("[::1]:7000", "127.0.0.1:7000", "localhost:7000"):
        info = DaemonInfo("d", address)
        assert trust.admit(prefix, prefix + b"d", info.encode(), 0) == info
    info = DaemonInfo("d", "10.0.0.5:7000")
    with pytest.raises(UntrustedRegistration):
        trust.admit(prefix, prefix + b"d", info.encode(), 0)
