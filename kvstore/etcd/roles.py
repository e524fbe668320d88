"""etcd roles: each component's credential may write only the keys it owns.

Without them, any credential etcd accepts (in Kubernetes: any certificate of the cluster CA)
is etcd root, and one stolen worker pod can rewrite every registration and binding. The one
permission table (`PERMISSIONS`, applied by `principals`):

| principal            | read                         | write                             |
|----------------------|------------------------------|-----------------------------------|
| `kvkeep-router`      | `{prefix}/workers/`, stores  | `{prefix}/sessions/`, `/prefetch/`|
| `kvkeep-worker-<id>` | its own key, stores          | `{prefix}/workers/<id>` only      |
| `kvkeep-daemon-<id>` | stores (peers, re-replicas)  | `{stores}<id>` only               |
| `kvkeep-connector`   | stores, `{prefix}/prefetch/` | nothing                           |
| a shared agent user  | its writes, stores           | the whole `{prefix}/workers/`     |
| a shared store user  | stores                       | the whole `{stores}` prefix       |

Why exactly these: the router lists and watches workers, and writes bindings in transactions
that compare and read the session key (kvstore/cluster/, router/state/etcd.py); a worker agent
and a daemon grant a lease, put their own key under it, read it back on every keepalive and
revoke the lease (kvstore/cluster/lease.py; etcd's LeaseRevoke needs write access to every key
attached); a daemon also watches its peers, and the vLLM connector and the router's
conversation records find the daemons under stores. Per-id grants are exact keys, never
prefixes (a prefix grant on `workers/w1` would also cover `workers/w10`). The shared users are
for deployments that cannot give each pod its own credential (deploy/k8s: one certificate per
component, whose CN is the etcd user): they keep a component off the others' keys, not off its
own kind's.

`apply_roles` makes etcd match the table: roles and users created or corrected (a permission
or role beyond the table is revoked), passwords set, `root` created where missing, and auth
enabled. It can run again at any time (new workers, rotated passwords); users and roles it is
not told about are left alone (remove a retired worker's with `etcdctl user delete`).
`kvkeep etcd roles` is its command line. aetcd has no auth API; this uses etcd's gRPC Auth
service through the one client builder (kvstore/etcd/client.py), so TLS and credentials work
as everywhere else.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from kvstore.errors import ConfigError
from kvstore.etcd.spec import EtcdSpec

__all__ = ["Grant", "Layout", "Principal", "principals", "router", "worker", "daemon",
           "connector", "shared_agents", "shared_stores", "apply_roles", "password_file",
           "register", "ROLE_PREFIX", "DEFAULT_STORES_PREFIX"]

ROLE_PREFIX = "kvkeep-"
DEFAULT_STORES_PREFIX = "/kvkeep/stores/"
"""kvstore.cluster.discovery.DEFAULT_PREFIX (not imported: this module stays cheap)."""

Perm = Literal["read", "write", "readwrite"]
_PERM_CODES: Mapping[Perm, int] = {"read": 0, "write": 1, "readwrite": 2}  # etcd's Permission.Type


def _prefix_end(key: bytes) -> bytes:
    """etcd's range end for "every key starting with `key`" (clientv3.GetPrefixRangeEnd)."""
    end = bytearray(key)
    for i in range(len(end) - 1, -1, -1):
        if end[i] < 0xFF:
            end[i] += 1
            return bytes(end[:i + 1])
    return b"\x00"  # every key


@dataclass(frozen=True, slots=True, order=True)
class Grant:
    """One permission: `key` alone (`range_end` empty) or the range [key, range_end)."""

    key: bytes
    range_end: bytes
    perm: Perm

    @classmethod
    def exact(cls, key: bytes, perm: Perm) -> Grant:
        return cls(key, b"", perm)

    @classmethod
    def prefix(cls, key: bytes, perm: Perm) -> Grant:
        return cls(key, _prefix_end(key), perm)


@dataclass(frozen=True, slots=True)
class Layout:
    """Where the keys are: the routers' and agents' `--etcd-prefix` and the daemons'."""

    prefix: str = "/kvkeep"
    stores_prefix: str = DEFAULT_STORES_PREFIX

    def __post_init__(self) -> None:
        if not self.prefix.strip("/") or not self.stores_prefix.strip("/"):
            raise ConfigError("etcd roles need non-empty prefixes (a grant on / is root)")

    @property
    def workers(self) -> bytes:
        return f"{self.prefix.rstrip('/')}/workers/".encode()

    @property
    def sessions(self) -> bytes:
        return f"{self.prefix.rstrip('/')}/sessions/".encode()

    @property
    def prefetch(self) -> bytes:
        """Failover's prefetch hints (kvstore/cluster/hints.py `hints_prefix`)."""
        return f"{self.prefix.rstrip('/')}/prefetch/".encode()

    @property
    def stores(self) -> bytes:
        return self.stores_prefix.encode()


@dataclass(frozen=True, slots=True)
class Principal:
    """One etcd user and the role (of the same name) that holds its grants."""

    user: str
    grants: tuple[Grant, ...]

    @property
    def role(self) -> str:
        return self.user


def _id(what: str, ident: str) -> str:
    if not ident or "/" in ident or ident != ident.strip():
        raise ConfigError(f"bad {what} id {ident!r} for an etcd role")
    return ident


def router(layout: Layout, user: str = "kvkeep-router") -> Principal:
    return Principal(user, (Grant.prefix(layout.workers, "read"),
                            Grant.prefix(layout.sessions, "readwrite"),
                            Grant.prefix(layout.prefetch, "write"),
                            Grant.prefix(layout.stores, "read")))


def worker(layout: Layout, worker_id: str) -> Principal:
    key = layout.workers + _id("worker", worker_id).encode()
    return Principal(f"{ROLE_PREFIX}worker-{worker_id}",
                     (Grant.exact(key, "readwrite"), Grant.prefix(layout.stores, "read")))


def daemon(layout: Layout, node_id: str) -> Principal:
    key = layout.stores + _id("daemon", node_id).encode()
    return Principal(f"{ROLE_PREFIX}daemon-{node_id}",
                     (Grant.exact(key, "readwrite"), Grant.prefix(layout.stores, "read")))


def connector(layout: Layout, user: str = "kvkeep-connector") -> Principal:
    # The hints prefix of every worker: connectors share one credential (per-worker ones
    # would need the worker id in the connector's etcd user, which vLLM's config cannot vary).
    return Principal(user, (Grant.prefix(layout.stores, "read"),
                            Grant.prefix(layout.prefetch, "read")))


def shared_agents(layout: Layout, user: str) -> Principal:
    """Every worker agent under one identity: the whole workers prefix, nothing else."""
    return Principal(user, (Grant.prefix(layout.workers, "readwrite"),
                            Grant.prefix(layout.stores, "read")))


def shared_stores(layout: Layout, user: str) -> Principal:
    """Every daemon under one identity: the whole stores prefix, nothing else."""
    return Principal(user, (Grant.prefix(layout.stores, "readwrite"),))


PERMISSIONS = {"router": router, "worker": worker, "daemon": daemon, "connector": connector,
               "shared-agents": shared_agents, "shared-stores": shared_stores}
"""The table, by kind: kind -> (layout, id or user name) -> Principal."""


def principals(layout: Layout, *, routers: Iterable[str] = (), workers: Iterable[str] = (),
               daemons: Iterable[str] = (), connectors: Iterable[str] = (),
               agents_user: str | None = None, stores_user: str | None = None
               ) -> list[Principal]:
    """Every principal of a deployment (`routers`/`connectors`: user names)."""
    found = [router(layout, u) for u in routers]
    found += [worker(layout, w) for w in workers]
    found += [daemon(layout, d) for d in daemons]
    found += [connector(layout, u) for u in connectors]
    if agents_user is not None:
        found.append(shared_agents(layout, agents_user))
    if stores_user is not None:
        found.append(shared_stores(layout, stores_user))
    names = [p.user for p in found]
    duplicate = {n for n in names if names.count(n) > 1}
    if duplicate or "root" in names:
        raise ConfigError(f"etcd users named twice (or root): {sorted(duplicate or {'root'})}")
    return found


# --- applying it --------------------------------------------------------------------------

@dataclass(slots=True)
class Applied:
    """What `apply_roles` changed (for the command's report and for tests)."""

    roles_added: list[str]
    users_added: list[str]
    grants_added: int = 0
    grants_revoked: int = 0
    roles_revoked: int = 0
    auth_enabled: bool = False


def _already(exc: BaseException) -> bool:
    return "already exists" in str(exc)


def _not_found(exc: BaseException) -> bool:
    return "not found" in str(exc)


async def _auth_stub(spec: EtcdSpec, timeout: float) -> tuple[Any, Any]:
    """A client and its Auth stub with root's powers: `spec` as given when etcd's auth is on;
    when it is off, the same endpoint without the user (etcd refuses to authenticate anyone
    before auth is enabled, and no credential is needed)."""
    import aetcd.rpc  # type: ignore[import-untyped, unused-ignore]

    from kvstore.etcd.client import etcd_client

    tries = [spec] if spec.user is None else [replace(spec, user=None, password_file=None), spec]
    last: BaseException | None = None
    for candidate in tries:
        client = etcd_client(candidate, timeout=timeout)
        await client.connect()
        stub = aetcd.rpc.AuthStub(client.channel)
        try:
            await stub.RoleList(aetcd.rpc.AuthRoleListRequest(), timeout=timeout)
            return client, stub
        except aetcd.rpc.AioRpcError as exc:
            last = exc
            await client.close()
    raise ConfigError(f"etcd at {spec.describe()} refused the administrator: {last}")


async def apply_roles(spec: EtcdSpec, wanted: Sequence[Principal], *,
                      passwords: Mapping[str, str | None], root_password: str | None = None,
                      enable: bool = True, timeout: float = 10.0) -> Applied:
    """Make etcd's roles and users those of `wanted` (see the module docstring).

    `spec`: root's credential (a certificate whose CN is root, or user root with its password
    file); before auth is enabled none is needed. `passwords`: per user, its password, or None
    for a user who authenticates only by client certificate (its CN). `root_password`: for
    creating root where it does not exist (None: root without a password, certificate only).
    """
    import aetcd.rpc

    missing = [p.user for p in wanted if p.user not in passwords]
    if missing:
        raise ConfigError(f"no password (or None) given for {missing}")
    client, stub = await _auth_stub(spec, timeout)
    rpc = aetcd.rpc
    done = Applied([], [])
    try:
        users = {u for u in (await stub.UserList(rpc.AuthUserListRequest(),
                                                 timeout=timeout)).users}
        roles = set((await stub.RoleList(rpc.AuthRoleListRequest(), timeout=timeout)).roles)
        if "root" not in users and root_password is None and spec.cert_file is None:
            # root would authenticate by a certificate named root only, and we show none:
            # enabling auth now could leave nobody able to change it again.
            raise ConfigError("creating root without a password needs root's client "
                              "certificate (--etcd-cert with CN root)")
        for principal in wanted:
            if principal.role not in roles:
                await stub.RoleAdd(rpc.AuthRoleAddRequest(name=principal.role), timeout=timeout)
                done.roles_added.append(principal.role)
            held = (await stub.RoleGet(rpc.AuthRoleGetRequest(role=principal.role),
                                       timeout=timeout)).perm
            want = {(g.key, g.range_end, _PERM_CODES[g.perm]) for g in principal.grants}
            have = {(bytes(p.key), bytes(p.range_end), int(p.permType)) for p in held}
            for key, end, _perm in sorted(have - want):
                await stub.RoleRevokePermission(rpc.AuthRoleRevokePermissionRequest(
                    role=principal.role, key=key, range_end=end), timeout=timeout)
                done.grants_revoked += 1
            for key, end, perm in sorted(want - have):
                await stub.RoleGrantPermission(rpc.AuthRoleGrantPermissionRequest(
                    name=principal.role, perm=rpc.Permission(permType=perm, key=key,
                                                             range_end=end)),
                    timeout=timeout)
                done.grants_added += 1
            await _ensure_user(stub, principal.user, passwords[principal.user],
                               principal.user in users, timeout, done)
            granted = set((await stub.UserGet(rpc.AuthUserGetRequest(name=principal.user),
                                              timeout=timeout)).roles)
            for extra in sorted(granted - {principal.role}):
                await stub.UserRevokeRole(rpc.AuthUserRevokeRoleRequest(
                    name=principal.user, role=extra), timeout=timeout)
                done.roles_revoked += 1
            if principal.role not in granted:
                await stub.UserGrantRole(rpc.AuthUserGrantRoleRequest(
                    user=principal.user, role=principal.role), timeout=timeout)
        if "root" not in users:
            await _ensure_user(stub, "root", root_password, False, timeout, done)
            await stub.UserGrantRole(rpc.AuthUserGrantRoleRequest(user="root", role="root"),
                                     timeout=timeout)
        if enable:
            await stub.AuthEnable(rpc.AuthEnableRequest(), timeout=timeout)
            done.auth_enabled = True
    except rpc.AioRpcError as exc:
        raise ConfigError(f"etcd refused a role change: {exc.details()}") from exc
    finally:
        await client.close()
    return done


async def _ensure_user(stub: Any, user: str, password: str | None, exists: bool,
                       timeout: float, done: Applied) -> None:
    import aetcd.rpc

    rpc = aetcd.rpc
    if not exists:
        await stub.UserAdd(rpc.AuthUserAddRequest(
            name=user, password=password or "",
            options=rpc.UserAddOptions(no_password=password is None)), timeout=timeout)
        done.users_added.append(user)
    elif password is not None and not await _accepts(stub, user, password, timeout):
        # A rotated password file is taken up; an unchanged one is left alone, since every
        # change makes etcd reject all tokens of all users until they authenticate again.
        await stub.UserChangePassword(rpc.AuthUserChangePasswordRequest(
            name=user, password=password), timeout=timeout)


async def _accepts(stub: Any, user: str, password: str, timeout: float) -> bool:
    import aetcd.rpc

    try:
        await stub.Authenticate(aetcd.rpc.AuthenticateRequest(name=user, password=password),
                                timeout=timeout)
    except aetcd.rpc.AioRpcError:  # a wrong password, or auth still off
        return False
    return True


# --- the command line ---------------------------------------------------------------------

def password_file(directory: Path, user: str) -> tuple[Path, str]:
    """`directory/user`: its first line, or a new random password written there (0600)."""
    path = directory / user
    if path.exists():
        lines = path.read_text().splitlines()
        if not lines or not lines[0].strip():
            raise ConfigError(f"the password file {path} is empty")
        return path, lines[0].strip()
    directory.mkdir(parents=True, exist_ok=True)
    password = secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(password + "\n")
    return path, password


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`kvkeep etcd roles ...`."""
    from kvstore.etcd.flags import add_etcd_arguments

    group = subparsers.add_parser("etcd", help="etcd administration")
    commands = group.add_subparsers(dest="etcd_command", required=True)
    roles = commands.add_parser(
        "roles", help="give each component an etcd user that writes only its own keys, and "
                      "enable etcd's auth", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    add_etcd_arguments(roles, required=True,
                       help="etcd URL(s); the credential flags are root's (none needed while "
                            "auth is still off)")
    roles.add_argument("--prefix", default="/kvkeep",
                       help="the routers' and agents' --etcd-prefix")
    roles.add_argument("--stores-prefix", default=DEFAULT_STORES_PREFIX,
                       help="the daemons' etcd prefix")
    roles.add_argument("--router", action="append", default=[], metavar="USER",
                       help="a router user (repeatable; e.g. kvkeep-router)")
    roles.add_argument("--worker", action="append", default=[], metavar="ID",
                       help="a worker id: user kvkeep-worker-ID, its key only (repeatable)")
    roles.add_argument("--daemon", action="append", default=[], metavar="ID",
                       help="a daemon node id: user kvkeep-daemon-ID, its key only")
    roles.add_argument("--connector", action="append", default=[], metavar="USER",
                       help="a read-only user of the daemons' registrations")
    roles.add_argument("--shared-agents", default=None, metavar="USER",
                       help="one user for every worker agent (the workers prefix only)")
    roles.add_argument("--shared-stores", default=None, metavar="USER",
                       help="one user for every daemon (the stores prefix only)")
    how = roles.add_mutually_exclusive_group(required=True)
    how.add_argument("--passwords", type=Path, default=None, metavar="DIR",
                     help="each user's password file is DIR/USER: read if it exists, else "
                          "made (0600); root's is DIR/root")
    how.add_argument("--certificates-only", action="store_true",
                     help="users (and a new root) without passwords: they authenticate by "
                          "client certificate, whose CN is the user name")
    roles.add_argument("--no-enable", action="store_true",
                       help="set roles and users but leave etcd's auth as it is")
    roles.set_defaults(handler=_roles_handler)


def _roles_handler(args: argparse.Namespace) -> int:
    from kvstore.etcd.flags import etcd_spec_from_args

    spec = etcd_spec_from_args(args, check_files=True)
    assert spec is not None  # --etcd is required
    layout = Layout(args.prefix, args.stores_prefix)
    wanted = principals(layout, routers=args.router, workers=args.worker,
                        daemons=args.daemon, connectors=args.connector,
                        agents_user=args.shared_agents, stores_user=args.shared_stores)
    passwords: dict[str, str | None] = {}
    files: dict[str, Path] = {}
    root_password: str | None = None
    for user in [p.user for p in wanted] + ["root"]:
        if args.passwords is None:
            passwords[user] = None
            continue
        files[user], passwords[user] = password_file(args.passwords, user)
    root_password = passwords.pop("root")
    done = asyncio.run(apply_roles(spec, wanted, passwords=passwords,
                                   root_password=root_password, enable=not args.no_enable))
    for p in wanted:
        where = files.get(p.user)
        print(f"{p.user}\t{'certificate CN' if where is None else where}\t" + ", ".join(
            f"{g.perm} {g.key.decode()}{'*' if g.range_end else ''}" for g in p.grants))
    print(f"roles added {len(done.roles_added)}, users added {len(done.users_added)}, grants "
          f"added {done.grants_added}, revoked {done.grants_revoked}; auth "
          f"{'enabled' if done.auth_enabled else 'left as it was'}", file=sys.stderr)
    return 0
