"""A small certificate authority for kvkeep clusters: a CA, the certificates it signs, and the
Ed25519 key pair daemons sign their etcd registrations with.

Used where no operator PKI exists yet: the local cluster's TLS option (`deploy/local/`), the
Kubernetes Secrets generator (`deploy/k8s_secrets.py`) and the tests. Keys are ECDSA P-256
(fast to make, accepted by etcd, gRPC and OpenSSL alike); every certificate carries both
serverAuth and clientAuth, because kvkeep's servers are also clients (a daemon pushes blocks to
its peers, and etcd members talk to each other).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = ["Authority", "IssuedCert", "CertPaths", "registration_keypair", "write_private"]

_DAY = datetime.timedelta(days=1)


@dataclass(frozen=True, slots=True)
class IssuedCert:
    """A certificate and its private key, PEM-encoded."""

    cert_pem: bytes
    key_pem: bytes


@dataclass(frozen=True, slots=True)
class CertPaths:
    """Where one identity's files were written: the CA that verifies peers, its cert and key."""

    ca: Path
    cert: Path
    key: Path


def write_private(path: Path, data: bytes) -> Path:
    """Write a secret file readable by its owner only (created 0600, never wider)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return path


def _private_pem(key: ec.EllipticCurvePrivateKey | ed25519.Ed25519PrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


class Authority:
    """A self-signed CA that issues leaf certificates."""

    def __init__(self, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate) -> None:
        self._key = key
        self.cert = cert

    @classmethod
    def create(cls, common_name: str = "kvkeep-ca", *, days: int = 3650) -> Authority:
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
        now = datetime.datetime.now(datetime.UTC)
        cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - _DAY).not_valid_after(now + days * _DAY)
                .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                .add_extension(x509.KeyUsage(
                    digital_signature=True, key_cert_sign=True, crl_sign=True,
                    content_commitment=False, key_encipherment=False, data_encipherment=False,
                    key_agreement=False, encipher_only=False, decipher_only=False),
                    critical=True)
                .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                               critical=False)
                .sign(key, hashes.SHA256()))
        return cls(key, cert)

    @property
    def cert_pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    def issue(self, common_name: str, *, dns: Sequence[str] = (), ips: Sequence[str] = (),
              days: int = 825) -> IssuedCert:
        """A leaf certificate for `common_name` (etcd takes it as the user name under
        --client-cert-auth) naming `dns` and `ips` as its subject alternative names."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        names: list[x509.GeneralName] = [x509.DNSName(d) for d in dns]
        names += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips]
        builder = (x509.CertificateBuilder()
                   .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME,
                                                               common_name)]))
                   .issuer_name(self.cert.subject).public_key(key.public_key())
                   .serial_number(x509.random_serial_number())
                   .not_valid_before(now - _DAY).not_valid_after(now + days * _DAY)
                   .add_extension(x509.BasicConstraints(ca=False, path_length=None),
                                  critical=True)
                   .add_extension(x509.KeyUsage(
                       digital_signature=True, key_encipherment=True, key_cert_sign=False,
                       crl_sign=False, content_commitment=False, data_encipherment=False,
                       key_agreement=False, encipher_only=False, decipher_only=False),
                       critical=True)
                   .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                         ExtendedKeyUsageOID.CLIENT_AUTH]),
                                  critical=False)
                   .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                       self._key.public_key()), critical=False))
        if names:
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        cert = builder.sign(self._key, hashes.SHA256())
        return IssuedCert(cert.public_bytes(serialization.Encoding.PEM), _private_pem(key))

    def write_ca(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(self.cert_pem)
        return path

    def issue_to(self, directory: Path, name: str, common_name: str, *,
                 dns: Sequence[str] = (), ips: Sequence[str] = ()) -> CertPaths:
        """Issue a certificate and write `<name>.pem`, `<name>.key` and `ca.pem` there."""
        issued = self.issue(common_name, dns=dns, ips=ips)
        cert = directory / f"{name}.pem"
        cert.parent.mkdir(parents=True, exist_ok=True)
        cert.write_bytes(issued.cert_pem)
        key = write_private(directory / f"{name}.key", issued.key_pem)
        return CertPaths(self.write_ca(directory / "ca.pem"), cert, key)


def registration_keypair() -> tuple[bytes, bytes]:
    """An Ed25519 key pair for signing daemon registrations: (private PEM, public PEM)."""
    key = ed25519.Ed25519PrivateKey.generate()
    public = key.public_key().public_bytes(serialization.Encoding.PEM,
                                           serialization.PublicFormat.SubjectPublicKeyInfo)
    return _private_pem(key), public
