"""Which daemon registrations a client believes: a registration is a claim, not a fact.

Anyone who can write under the registration prefix in etcd could otherwise name any address a
daemon, and every client would send it its tenant's bearer token (and re-replication the `*`
peer token). A client only sends a token to a daemon that proves its identity, in one of two
ways (both may be on):

- **mTLS against the cluster CA** (`tls=True`: the client dials daemons with `ClientTLS`):
  the proof happens in the handshake, before any token is sent. gRPC checks the daemon's
  certificate chain against the CA and its name against the address dialled (or against
  `ClientTLS.server_name`, when every daemon carries one shared name). A forged address gets a
  handshake its owner cannot complete without a key the CA signed. It also protects the wire:
  tokens and KV are encrypted. The TCP data plane has no TLS, so with TLS blocks travel over
  gRPC+TLS only (adding TLS to the TCP plane would cost most of what makes it faster).
- **Signed registrations** (`verify_keys`): daemons hold an Ed25519 cluster key
  (`--registration-key`) and sign what they register; clients hold only the public key. The
  signature covers the etcd key, the etcd lease the registration is attached to, and every
  field (node id, gRPC and data-plane addresses, start time), so a value can neither be
  altered, moved to another key, nor replayed after its daemon's lease ended (leases are never
  reused). This proves the registration came from a daemon, not that the network path to it
  is safe: without TLS, tokens still cross the network in clear (the TCP data plane stays
  usable, its address being signed).

A client with neither believes only registrations whose addresses are all loopback (the same
trust the daemon itself gives loopback: without a token file it serves only there).
Everything else is ignored and counted by reason. Registrations from a static list (the
config's `daemons`) are the operator's own and are not checked here.

Two rules hold whatever the proof (the watcher applies them, kvstore/cluster/discovery.py): a
registration counts only while attached to a lease (a lease-less one was written by hand and
would outlive any daemon), and one address is one daemon (`identities`): under TLS-only trust
the handshake proves a daemon holds a CA key, not which node id it is, so without this rule one
etcd writer could register aliases of one daemon under many ids and clients would place two
replicas of a block on it (L1).
"""

from __future__ import annotations

import base64
import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from kvstore.cluster.daemon_info import DaemonInfo
from kvstore.errors import ConfigError, UntrustedRegistration
from kvstore.net.addresses import ip_literal, is_loopback

__all__ = ["DaemonTrust", "RegistrationSigner", "identities", "load_verify_keys",
           "signed_message"]

_CONTEXT = b"kvkeep-daemon-registration-v1"
_PEM_END = b"-----END PUBLIC KEY-----"


def _is_loopback(address: str) -> bool:
    """Whether a registered HOST:PORT is on this machine's loopback."""
    return is_loopback(address.rpartition(":")[0])


def identities(info: DaemonInfo) -> tuple[str, ...]:
    """The endpoint a registration claims (its gRPC address), spelled one way (an IP literal
    canonical, a name lower-case, localhost as 127.0.0.1), so that two spellings of one
    endpoint are one claim. Only the gRPC address: under TLS, the case aliases exploit, blocks
    travel over gRPC only, and a signed registration covers its data-plane address anyway.
    Names are not resolved: two DNS names of one host stay two claims."""
    host, _, port = info.address.rpartition(":")
    literal = ip_literal(host)
    name = host.strip("[]").lower().rstrip(".")
    canonical = (str(literal) if literal is not None
                 else "127.0.0.1" if name == "localhost" else name)
    return (f"{canonical}:{int(port)}",)


def signed_message(key: bytes, lease: int, info: DaemonInfo) -> bytes:
    """The bytes a registration's signature covers: every field, length-prefixed (so that no
    two different registrations share a message), after a context string."""
    fields = (key, str(int(lease)).encode(), info.node_id.encode(), info.address.encode(),
              info.data_address.encode(), repr(float(info.started_at)).encode())
    return _CONTEXT + b"".join(struct.pack(">I", len(f)) + f for f in fields)


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read the {what} {path}: {exc}") from exc


class RegistrationSigner:
    """The daemons' side: signs what the registrar writes (kvstore/daemon/registration.py)."""

    def __init__(self, key: Ed25519PrivateKey) -> None:
        self._key = key

    @classmethod
    def from_file(cls, path: Path) -> RegistrationSigner:
        """An Ed25519 private key, PEM (PKCS#8): `openssl genpkey -algorithm ed25519`."""
        try:
            key = serialization.load_pem_private_key(_read(path, "registration key"), None)
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"{path} is not a PEM private key: {exc}") from exc
        if not isinstance(key, Ed25519PrivateKey):
            raise ConfigError(f"{path}: the registration key must be Ed25519")
        return cls(key)

    @property
    def public_key(self) -> Ed25519PublicKey:
        return self._key.public_key()

    def encode(self, key: bytes, lease: int, info: DaemonInfo) -> bytes:
        """The registration value: the daemon's fields (as unsigned ones, so that any reader
        parses it) plus `sig`."""
        fields = json.loads(info.encode())
        fields["sig"] = base64.b64encode(self._key.sign(signed_message(key, lease, info))
                                         ).decode()
        return json.dumps(fields, separators=(",", ":")).encode()


def load_verify_keys(path: Path) -> tuple[Ed25519PublicKey, ...]:
    """Every Ed25519 public key (PEM) in `path`: several let a cluster rotate its key (clients
    accept old and new while the daemons move over)."""
    data = _read(path, "registration public key")
    keys: list[Ed25519PublicKey] = []
    for block in data.split(_PEM_END)[:-1]:
        try:
            key = serialization.load_pem_public_key(block + _PEM_END)
        except ValueError as exc:
            raise ConfigError(f"{path}: not a PEM public key: {exc}") from exc
        if not isinstance(key, Ed25519PublicKey):
            raise ConfigError(f"{path}: registration keys must be Ed25519")
        keys.append(key)
    if not keys:
        raise ConfigError(f"{path} holds no PEM public key")
    return tuple(keys)


@dataclass(frozen=True, slots=True)
class DaemonTrust:
    """What a client requires of a registration before it believes it (module docstring)."""

    verify_keys: tuple[Ed25519PublicKey, ...] = ()
    """Registrations must carry a signature by one of these."""
    tls: bool = False
    """The client dials daemons over mTLS: the handshake proves each daemon's identity."""

    @classmethod
    def of(cls, *, public_key_file: Path | None, tls: bool,
           extra_keys: Sequence[Ed25519PublicKey] = ()) -> DaemonTrust:
        keys = tuple(extra_keys) + (() if public_key_file is None
                                    else load_verify_keys(public_key_file))
        return cls(keys, tls)

    def describe(self) -> str:
        proofs = (["signed registrations"] if self.verify_keys else []) + (
            ["mTLS"] if self.tls else [])
        return " and ".join(proofs) or "none (loopback daemons only)"

    def admit(self, prefix: bytes, key: bytes, value: bytes, lease: int) -> DaemonInfo:
        """The daemon a registration describes, or UntrustedRegistration saying why not."""
        try:
            info = DaemonInfo.decode(value)
        except ConfigError as exc:
            raise UntrustedRegistration("malformed", str(exc)) from exc
        if key != prefix + info.node_id.encode():
            # A copy of a good value under another key would let a delete of that key
            # remove the real daemon from every client's view.
            raise UntrustedRegistration("wrong key", f"{key!r} registers node {info.node_id}")
        if self.verify_keys:
            self._check_signature(key, lease, value, info)
            return info
        if self.tls:
            return info
        if _is_loopback(info.address) and (not info.data_address
                                           or _is_loopback(info.data_address)):
            return info
        raise UntrustedRegistration(
            "unproven", f"{info.node_id} at {info.address} cannot prove it is a daemon: give "
            "clients TLS to the daemons (the cluster CA) or the registration public key")

    def _check_signature(self, key: bytes, lease: int, value: bytes, info: DaemonInfo) -> None:
        try:
            signature = base64.b64decode(str(json.loads(value)["sig"]), validate=True)
        except (KeyError, ValueError, TypeError) as exc:
            raise UntrustedRegistration("unsigned", f"{info.node_id}: no valid signature"
                                        ) from exc
        if not lease:
            raise UntrustedRegistration("no lease", f"{info.node_id}: not under a lease")
        message = signed_message(key, lease, info)
        for verify_key in self.verify_keys:
            try:
                verify_key.verify(signature, message)
                return
            except InvalidSignature:
                continue
        raise UntrustedRegistration("bad signature",
                                    f"{info.node_id}: signature does not verify")
