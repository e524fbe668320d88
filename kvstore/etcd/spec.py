"""`EtcdSpec`: how to reach etcd and prove who we are to it, as one checked value.

The URL's scheme decides the transport, and nothing else may: `https://` means TLS (verified
against `ca_file`, or the system's roots without one) or an error, never plaintext; `http://`
means plaintext, and TLS material given with it is an error rather than silently unused.
Every endpoint of a list must share one scheme. `cert_file`/`key_file` is a client
certificate (etcd's `--client-cert-auth`; with etcd's auth on, its CN is the user name);
`user` with `password_file` is etcd's user/password auth. The password stays in its file
(read when a client is built, so a rotated Secret is picked up on reconnect) and is never
part of a log line or a repr.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from kvstore.errors import ConfigError
from kvstore.net.addresses import is_loopback

__all__ = ["EtcdSpec", "etcd_spec"]

_log = logging.getLogger(__name__)
_SCHEMES = ("http", "https")


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read the etcd {what} {path}: {exc}") from exc


def _endpoint(part: str) -> tuple[str, str, int]:
    text = part.strip()
    split = urlsplit(text if "://" in text else f"http://{text}")
    if split.scheme not in _SCHEMES:
        raise ConfigError(f"etcd endpoint {part!r}: the scheme must be http or https")
    if split.hostname is None or split.path not in ("", "/") or split.query:
        raise ConfigError(f"bad etcd endpoint {part!r}: use http(s)://HOST:PORT")
    try:
        port = split.port or 2379
    except ValueError as exc:
        raise ConfigError(f"bad etcd endpoint {part!r}: {exc}") from exc
    return split.scheme, split.hostname, port


@dataclass(frozen=True, slots=True)
class EtcdSpec:
    """Endpoints (`url`: one or a comma-separated list) and our credentials for them."""

    url: str
    ca_file: Path | None = None
    """CA that signed the etcd servers' certificates (https only; None: the system's roots)."""
    cert_file: Path | None = None
    key_file: Path | None = None
    user: str | None = None
    password_file: Path | None = None

    def __post_init__(self) -> None:
        parsed = [_endpoint(p) for p in self.url.split(",") if p.strip()]
        if not parsed:
            raise ConfigError("no etcd endpoint given")
        schemes = {scheme for scheme, _, _ in parsed}
        if len(schemes) > 1:
            raise ConfigError(f"etcd endpoints {self.url!r} mix http and https: use one scheme")
        if (self.cert_file is None) != (self.key_file is None):
            raise ConfigError("an etcd client certificate needs both --etcd-cert and --etcd-key")
        if (self.user is None) != (self.password_file is None):
            raise ConfigError("etcd user auth needs both --etcd-user and --etcd-password-file")
        if self.user is not None and not self.user.strip():
            raise ConfigError("the etcd user name is empty")
        if schemes == {"http"} and (self.ca_file or self.cert_file):
            raise ConfigError(f"etcd TLS files given but {self.url!r} is plain http: write "
                              "https:// to use TLS (a TLS setting is never silently ignored)")
        if schemes == {"http"} and self.user is not None and not all(
                is_loopback(host) for _, host, _ in parsed):
            _log.warning("etcd user %s authenticates over plain http to %s: the password "
                         "crosses the network in clear (use https://)", self.user, self.url)

    @property
    def secure(self) -> bool:
        """True when every connection is TLS (the endpoints are https://)."""
        return self.url.lstrip().lower().startswith("https://")

    @property
    def endpoints(self) -> tuple[tuple[str, int], ...]:
        """(host, port) of every endpoint, in the order given."""
        return tuple((host, port) for _, host, port in
                     (_endpoint(p) for p in self.url.split(",") if p.strip()))

    def describe(self) -> str:
        """For log lines: where, and how we authenticate (never a secret)."""
        how = ["TLS" if self.secure else "plaintext"]
        if self.cert_file is not None:
            how.append("client certificate")
        if self.user is not None:
            how.append(f"user {self.user}")
        return f"{self.url} ({', '.join(how)})"

    def password(self) -> str | None:
        """The password: the first line of `password_file` (None without user auth)."""
        if self.password_file is None:
            return None
        lines = _read(self.password_file, "password file").decode().splitlines()
        password = lines[0].strip() if lines else ""
        if not password:
            raise ConfigError(f"the etcd password file {self.password_file} is empty")
        return password

    def channel_credentials(self) -> Any:
        """gRPC channel credentials for https endpoints; None for http."""
        if not self.secure:
            return None
        import grpc  # type: ignore[import-untyped, unused-ignore]

        return grpc.ssl_channel_credentials(
            None if self.ca_file is None else _read(self.ca_file, "CA file"),
            None if self.key_file is None else _read(self.key_file, "client key"),
            None if self.cert_file is None else _read(self.cert_file, "client certificate"))

    def check_files(self) -> None:
        """Read every file now: a command fails at start-up, not at its first reconnect."""
        self.channel_credentials()
        self.password()


def etcd_spec(value: EtcdSpec | str) -> EtcdSpec:
    """A spec as given, or one for a bare URL (its scheme alone decides TLS)."""
    return value if isinstance(value, EtcdSpec) else EtcdSpec(value)
