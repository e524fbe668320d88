"""The chaos suite's fault tools against real processes: a kvstore daemon whose block files are
corrupted (and the probe that must find no corrupt read served), etcd registrations leaving,
network namespaces cutting one service off, a tmpfs that fills. Root-only tools are skipped
with the reason when not root."""

from __future__ import annotations

import errno
import os
import random
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from deploy.chaos.counters import daemon_counters
from deploy.chaos.registrations import RegistrationWatch
from deploy.chaos.storage import CorruptedBlock, corrupt_blocks, probe_corrupted
from deploy.local.daemons import start_daemon
from deploy.local.disks import FILLER_NAME, fill, mount_tmpfs, tmpfs_available, unmount
from deploy.local.netns import Fabric, netns_available
from deploy.local.services import EtcdServer
from kvstore.net.scope import Scope
from tests.blockframes import FINGERPRINT, NAMESPACE, block_key, make_frame


def _drained(address: str) -> bool:
    from kvstore.net.daemon_client import DaemonClient

    client = DaemonClient("probe", address)
    try:
        return client.stat(timeout=2.0).pending_writes == 0
    finally:
        client.close()


def _wait(ready: object, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ready():  # type: ignore[operator]
            return
        time.sleep(0.05)
    raise TimeoutError("condition not met")


@pytest.mark.timeout(120)
def test_corrupted_block_files_are_never_served_as_valid(tmp_path: Path) -> None:
    daemon = start_daemon(tmp_path, "d1", mem_budget="4MiB")
    try:
        client = daemon.client()
        scope = Scope(FINGERPRINT.digest, NAMESPACE)
        keys = [block_key(i) for i in range(24)]
        frames = {k.digest: make_frame(k, segment_bytes=4096) for k in keys}
        assert all(client.put(scope, [(k.block_hash, frames[k.digest])], timeout=5.0)
                   for k in keys)
        _wait(lambda: _drained(daemon.address))
        corrupted = corrupt_blocks("d1", daemon.data_dir, 8, random.Random(0))
        assert len(corrupted) == 8 and {c.where for c in corrupted} == {"payload", "header"}
        for c in corrupted:  # the files on disk really differ from what was stored
            assert (next(daemon.data_dir.rglob(c.key.digest.hex() + ".kvb")).read_bytes()
                    != c.original)
            assert c.original == frames[c.key.digest]
        untouched = next(k for k in keys if k not in {c.key for c in corrupted})
        control = CorruptedBlock("d1", untouched, frames[untouched.digest], "none")
        daemon.close_clients()
        daemon.restart()  # RAM copies gone: every read comes from the damaged disk
        result = probe_corrupted([*corrupted, control], {"d1": daemon.address}, None)
        assert result.served_corrupt == 0
        assert result.intact == 1                          # the control block, read back whole
        assert result.misses + result.rejected == 8        # every damaged copy refused
        assert result.probes == 9 and result.errors == 0
        counters = daemon_counters(daemon.address, None)
        assert counters is not None and counters["corrupt_blocks"] >= 1
        assert counters["nvme_corrupt"] == counters["corrupt_blocks"]
    finally:
        daemon.close_clients()
        daemon.kill()


def test_daemon_counters_of_a_dead_daemon_are_none(tmp_path: Path) -> None:
    daemon = start_daemon(tmp_path, "d1")
    address = daemon.address
    before = daemon_counters(address, None)
    daemon.kill()
    assert before is not None and before["puts"] == 0
    assert daemon_counters(address, None, timeout_s=0.5) is None


def _etcdctl(server: EtcdServer, *args: str) -> None:
    subprocess.run(["etcdctl", "--endpoints", server.url, *args], check=True,
                   capture_output=True, env={"ETCDCTL_API": "3", "PATH": "/usr/bin:/bin"})


@pytest.mark.timeout(60)
def test_registration_watch_times_each_departure(etcd_server: EtcdServer) -> None:
    watch = RegistrationWatch(etcd_server.url)
    assert watch.available
    watch.start()
    try:
        time.sleep(1.0)  # the watch is established
        _etcdctl(etcd_server, "put", "/kvkeep/workers/w1", "{}")
        _etcdctl(etcd_server, "put", "/kvkeep/stores/d1", "{}")
        _etcdctl(etcd_server, "put", "/kvkeep/sessions/s1", "{}")   # not a registration
        _etcdctl(etcd_server, "del", "/kvkeep/workers/w1")
        _etcdctl(etcd_server, "del", "/kvkeep/sessions/s1")
        time.sleep(0.3)
        _etcdctl(etcd_server, "put", "/kvkeep/workers/w1", "{}")
        _etcdctl(etcd_server, "del", "/kvkeep/stores/d1")
        _wait(lambda: len(watch.departures()) == 2, timeout=10.0)
    finally:
        watch.stop()
    worker, store = watch.departures()
    assert (worker.kind, worker.name, store.kind, store.name) == ("worker", "w1", "daemon", "d1")
    assert worker.back_at is not None and worker.back_at - worker.left_at >= 0.25
    assert store.back_at is None


@pytest.fixture
def fabric() -> Iterator[Fabric]:
    why = netns_available()
    if why is not None:
        pytest.skip(why)
    made = Fabric.create()
    try:
        yield made
    finally:
        made.destroy()


def _listen(address: str) -> tuple[socket.socket, int]:
    sock = socket.socket()
    sock.bind((address, 0))
    sock.listen()

    def accept() -> None:
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            conn.close()

    threading.Thread(target=accept, daemon=True).start()
    return sock, int(sock.getsockname()[1])


@pytest.mark.timeout(60)
def test_a_cut_loses_one_service_silently_and_heals(fabric: Fabric) -> None:
    node = fabric.add_node("w2")
    etcd, etcd_port = _listen(fabric.etcd_address)
    daemons, daemons_port = _listen(fabric.daemons_address)
    try:
        assert fabric.reaches("w2", fabric.etcd_address, etcd_port)
        assert fabric.reaches("w2", fabric.daemons_address, daemons_port)
        fabric.cut("w2", "etcd")
        started = time.monotonic()
        assert not fabric.reaches("w2", fabric.etcd_address, etcd_port, timeout_s=1.0)
        assert time.monotonic() - started >= 0.9  # lost, not refused: it waited out its timeout
        assert fabric.reaches("w2", fabric.daemons_address, daemons_port)
        # The host (a router) still reaches the node while it is cut off from etcd.
        server = subprocess.Popen(fabric.wrap("w2", [
            "python3", "-c", "import socket,time; s=socket.socket(); "
            f"s.bind(('{node.address}', 47011)); s.listen(); time.sleep(5)"]))
        try:
            deadline = time.monotonic() + 5
            while True:
                try:
                    socket.create_connection((node.address, 47011), 1.0).close()
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)
        finally:
            server.kill()
            server.wait()
        fabric.cut("w2", "daemons")
        assert not fabric.reaches("w2", fabric.daemons_address, daemons_port, timeout_s=0.5)
        fabric.heal("w2", "etcd")
        fabric.heal("w2", "daemons")
        assert fabric.reaches("w2", fabric.etcd_address, etcd_port)
        assert fabric.reaches("w2", fabric.daemons_address, daemons_port)
    finally:
        etcd.close()
        daemons.close()
    netns = node.netns
    fabric.destroy()
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                            check=True).stdout
    assert netns not in listed


@pytest.mark.timeout(60)
def test_a_tmpfs_disk_fills_to_enospc_and_frees(tmp_path: Path) -> None:
    why = tmpfs_available()
    if why is not None:
        pytest.skip(why)
    disk = tmp_path / "disk"
    mount_tmpfs(disk, 4 << 20)
    try:
        (disk / "data").write_bytes(b"x" * 4096)
        written = fill(disk)
        assert written > 3 << 20
        with pytest.raises(OSError) as full, (disk / "more").open("wb") as f:
            f.write(os.urandom(64 << 10))
            f.flush()
            os.fsync(f.fileno())
        assert full.value.errno == errno.ENOSPC
        (disk / "more").unlink(missing_ok=True)
        (disk / FILLER_NAME).unlink()
        (disk / "more").write_bytes(os.urandom(64 << 10))   # room again
        assert (disk / "data").read_bytes() == b"x" * 4096
    finally:
        unmount(disk)
    assert not os.path.ismount(disk)
