"""A real etcd with TLS (and optionally client-certificate auth and etcd's own user auth) on a
free loopback port, with the certificates made for it by deploy/pki.py.

    with start_secure_etcd(tmp, client_cert_auth=True, users={"kvkeep": "pw"}) as etcd:
        etcd.url                       # https://127.0.0.1:PORT
        etcd.client("kvkeep")          # CertPaths of a client certificate whose CN is kvkeep
        etcd.etcdctl("get", "--prefix", "/")

Users get a role with read-write access to every key; `root` exists (etcd requires it before
`auth enable`). Stopped by pid like deploy/local/services.py's etcd.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from deploy.local.services import free_port, stop_process, wait_for_port
from deploy.pki import Authority, CertPaths

__all__ = ["SecureEtcd", "start_secure_etcd"]


@dataclass
class SecureEtcd:
    proc: subprocess.Popen[bytes]
    port: int
    directory: Path
    authority: Authority
    server: CertPaths
    client_cert_auth: bool
    argv: list[str] = field(default_factory=list)
    passwords: dict[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    @property
    def ca(self) -> Path:
        return self.server.ca

    def restart(self) -> None:
        """Stop etcd and start it again on the same port and data (its tokens are gone)."""
        stop_process(self.proc, signal.SIGTERM)
        self.proc = _spawn(self.argv)
        wait_for_port(self.port, proc=self.proc)

    def client(self, common_name: str) -> CertPaths:
        """A client certificate (made once per name) whose CN etcd takes as the user name."""
        directory = self.directory / "clients"
        cert = directory / f"{common_name}.pem"
        if cert.exists():
            return CertPaths(directory / "ca.pem", cert, directory / f"{common_name}.key")
        return self.authority.issue_to(directory, common_name, common_name)

    def password_file(self, user: str) -> Path:
        path = self.directory / f"{user}.password"
        path.write_text(self.passwords[user] + "\n")
        return path

    def etcdctl(self, *args: str, user: str = "root") -> str:
        """Run etcdctl as `user` (by certificate under client-cert auth, else by password)."""
        etcdctl = shutil.which("etcdctl")
        assert etcdctl is not None, "etcdctl not installed: run `make setup`"
        argv = [etcdctl, "--endpoints", self.url, "--cacert", str(self.ca),
                "--dial-timeout", "5s", "--command-timeout", "10s"]
        if self.client_cert_auth:
            paths = self.client(user)
            argv += ["--cert", str(paths.cert), "--key", str(paths.key)]
        elif user in self.passwords:
            argv += ["--user", f"{user}:{self.passwords[user]}"]
        done = subprocess.run([*argv, *args], capture_output=True, text=True, timeout=30,
                              check=False, env={**os.environ, "ETCDCTL_API": "3"})
        if done.returncode != 0:
            raise RuntimeError(f"etcdctl {' '.join(args)} failed: {done.stderr.strip()}")
        return done.stdout


def _enable_auth(etcd: SecureEtcd, users: Mapping[str, str]) -> None:
    etcd.passwords["root"] = "root-password-0123"
    etcd.etcdctl("user", "add", f"root:{etcd.passwords['root']}")
    etcd.etcdctl("user", "grant-role", "root", "root")
    etcd.etcdctl("role", "add", "kvkeep-all")
    etcd.etcdctl("role", "grant-permission", "kvkeep-all", "--prefix=true", "readwrite", "/")
    for user, password in users.items():
        etcd.passwords[user] = password
        etcd.etcdctl("user", "add", f"{user}:{password}")
        etcd.etcdctl("user", "grant-role", user, "kvkeep-all")
    etcd.etcdctl("auth", "enable")


def _spawn(argv: list[str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "ETCD_UNSUPPORTED_ARCH":
                                 os.environ.get("ETCD_UNSUPPORTED_ARCH", "")})


@contextlib.contextmanager
def start_secure_etcd(tmp: Path, *, client_cert_auth: bool = True,
                      users: Mapping[str, str] | None = None,
                      extra: tuple[str, ...] = ()) -> Iterator[SecureEtcd]:
    """TLS always; `client_cert_auth`: clients must show a certificate of the CA; `users`
    (name -> password): turn on etcd's auth with these users (None: auth off)."""
    etcd_bin = shutil.which("etcd")
    if etcd_bin is None:
        raise RuntimeError("etcd not installed: run `make setup`")
    port, peer_port = free_port(), free_port()
    directory = tmp / f"secure-etcd-{port}"
    authority = Authority.create("kvkeep-test-ca")
    server = authority.issue_to(directory / "server", "server", "etcd-server",
                                dns=("localhost",), ips=("127.0.0.1",))
    url, peer = f"https://127.0.0.1:{port}", f"http://127.0.0.1:{peer_port}"
    argv = [etcd_bin, "--name", "t", "--data-dir", str(directory / "data"),
            "--listen-client-urls", url, "--advertise-client-urls", url,
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"t={peer}",
            "--cert-file", str(server.cert), "--key-file", str(server.key),
            "--heartbeat-interval", "10", "--election-timeout", "100", "--unsafe-no-fsync",
            "--log-level", "error", *extra]
    if client_cert_auth:
        argv += ["--client-cert-auth", "--trusted-ca-file", str(server.ca)]
    proc = _spawn(argv)
    etcd = SecureEtcd(proc, port, directory, authority, server, client_cert_auth, argv)
    try:
        wait_for_port(port, proc=proc)
        if users is not None:
            _enable_auth(etcd, users)
        yield etcd
    finally:
        stop_process(etcd.proc, signal.SIGTERM)
