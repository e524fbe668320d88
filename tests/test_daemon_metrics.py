"""A real daemon's `/metrics`: what its store, core, both fronts and repairs did, scraped.

Daemons run as subprocesses (deploy/local/daemons.py); traffic goes over gRPC and over the TCP
data plane with the real client; values are read back from the Prometheus text the endpoint
serves.
"""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path

import pytest

from deploy.local.daemons import running_daemons, start_daemon
from deploy.local.services import EtcdServer, free_port
from kvstore.daemon.config import DaemonConfig
from kvstore.errors import ConfigError, TierError
from kvstore.net.daemon_client import DaemonClient
from kvstore.net.scope import scope_of
from tests.blockframes import block_key, corrupt, make_frame
from tests.metrics_scrape import scrape, wait_for_sample

T = 10.0


def _put(client: DaemonClient, first: int, count: int, **frame: int) -> list[bool]:
    keys = [block_key(i) for i in range(first, first + count)]
    return client.put(scope_of(keys[0]), [(k.block_hash, make_frame(k, **frame)) for k in keys],
                      timeout=T)


def test_block_traffic_on_both_fronts_is_counted(tmp_path: Path) -> None:
    port = free_port()
    # 4 MiB of RAM for ~64 KiB frames: the host tier evicts as blocks keep coming.
    daemon = start_daemon(tmp_path, "m1", mem_budget="4MiB",
                          extra=["--metrics-listen", f"127.0.0.1:{port}"])
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        grpc_client = DaemonClient("m1", daemon.address, data_plane=False)
        tcp_client = DaemonClient("m1", daemon.address)
        assert _put(grpc_client, 0, 40, segment_bytes=16384) == [True] * 40
        assert _put(tcp_client, 100, 40, segment_bytes=16384) == [True] * 40
        scope = scope_of(block_key(0))
        assert tcp_client.get(scope, block_key(139).block_hash, timeout=T) is not None
        assert grpc_client.get(scope, block_key(138).block_hash, timeout=T) is not None
        assert tcp_client.get(scope, b"never-stored", timeout=T) is None
        bad = corrupt(make_frame(block_key(500)))
        for client in (grpc_client, tcp_client):
            with pytest.raises(TierError):
                client.put(scope, [(block_key(500).block_hash, bad)], timeout=T)
        assert tcp_client.data_plane_address is not None  # the TCP front really served it

        # A refused call is counted by the gRPC front's interceptor as the handler unwinds, and
        # a data plane request once its reply is sent: either can be after the client has its
        # status. Wait for those counts too.
        m = wait_for_sample(url, lambda s: s.value("kvkeep_daemon_pending_writes") == 0 and all(
            s.value("kvkeep_daemon_put_refusals_total", front=front,
                    reason="INVALID_ARGUMENT") >= 1 for front in ("grpc", "tcp"))
            and s.value("kvkeep_daemon_requests_total", front="tcp", rpc="Put",
                        code="INVALID_ARGUMENT") >= 1)
        # Every block is on disk, or was evicted from RAM before the writer got to it.
        assert m.value("kvkeep_daemon_tier_blocks", tier="nvme") + m.value(
            "kvkeep_store_write_behind_dropped_total", reason="source_gone") == 80
        assert m.value("kvkeep_daemon_info", node_id="m1") == 1
        assert m.value("kvkeep_daemon_puts_total") == 80
        assert m.value("kvkeep_daemon_hits_total") == 2
        assert m.value("kvkeep_daemon_misses_total") == 1
        assert m.value("kvkeep_daemon_invalid_puts_total") == 2
        assert m.value("kvkeep_daemon_put_bytes_received_total") > 80 * 65536
        for front in ("grpc", "tcp"):
            assert m.value("kvkeep_daemon_requests_total", front=front, rpc="Put",
                           code="OK") >= 1
            assert m.value("kvkeep_daemon_requests_total", front=front, rpc="Get",
                           code="OK") >= 1
            assert m.value("kvkeep_daemon_put_refusals_total", front=front,
                           reason="INVALID_ARGUMENT") == 1
            assert m.value("kvkeep_daemon_put_refusals_total", front=front,
                           reason="PERMISSION_DENIED") == 0
            assert m.value("kvkeep_daemon_request_seconds_count", front=front, rpc="Put") >= 1
        assert m.value("kvkeep_daemon_requests_total", front="tcp", rpc="Put",
                       code="INVALID_ARGUMENT") == 1
        # The unary calls are timed too (the client asked Stat for the data port).
        assert m.value("kvkeep_daemon_requests_total", front="grpc", rpc="Stat") >= 1
        assert 0 < m.value("kvkeep_daemon_tier_bytes", tier="host") <= \
            m.value("kvkeep_daemon_tier_budget_bytes", tier="host")
        assert m.value("kvkeep_daemon_tier_evicted_blocks_total", tier="host") > 0
        assert m.value("kvkeep_daemon_tier_evicted_blocks_total", tier="nvme") == 0
        assert m.value("kvkeep_store_hits_total", tier="host") + \
            m.value("kvkeep_store_hits_total", tier="nvme") >= 1
        assert m.value("kvkeep_store_corrupt_blocks_total", tier="nvme") == 0
        assert m.value("kvkeep_store_written_bytes_total", tier="nvme") > 0
        assert m.value("kvkeep_store_write_behind_dropped_total", reason="queue_full") == 0
        assert m.value("kvkeep_daemon_draining") == 0
        assert m.value("kvkeep_daemon_catalog_keys") == 80
        assert "kvkeep_daemon_rereplication_passes_total" not in m.names  # no etcd, no repairs
        grpc_client.close()
        tcp_client.close()

        # A block whose file rots on disk: a miss, counted as corrupt where it was found.
        assert daemon.terminate() == 0
        files = sorted(p for p in (daemon.data_dir / "blocks").rglob("*") if p.is_file()
                       and p.stat().st_size > 60000)
        assert len(files) >= 10
        for path in files:
            data = bytearray(path.read_bytes())
            data[len(data) // 2] ^= 0x40
            path.write_bytes(bytes(data))
        daemon.spawn()
        daemon.wait_healthy()
        client = DaemonClient("m1", daemon.address)
        for i in (*range(40), *range(100, 140)):
            assert client.get(scope, block_key(i).block_hash, timeout=T) is None
        client.close()
        after = scrape(url)
        assert after.value("kvkeep_store_corrupt_blocks_total", tier="nvme") == len(files)
        assert after.value("kvkeep_daemon_misses_total") == 80
    finally:
        daemon.close_clients()
        daemon.terminate()


def test_auto_port_is_logged_and_off_serves_nothing(tmp_path: Path) -> None:
    auto = start_daemon(tmp_path, "auto")
    off = start_daemon(tmp_path, "quiet", extra=["--metrics-listen", "off"])
    try:
        found = re.search(r"metrics on (http://127\.0\.0\.1:\d+/metrics)", auto.log_text())
        assert found is not None, auto.log_text()
        assert scrape(found.group(1)).value("kvkeep_daemon_info", node_id="auto") == 1
        with urllib.request.urlopen(found.group(1), timeout=T) as resp:
            assert resp.headers["Content-Type"].startswith("text/plain")
        assert "metrics: off" in off.log_text()
        assert "metrics on" not in off.log_text()
    finally:
        auto.terminate()
        off.terminate()


def test_metrics_listen_is_checked_like_the_other_listeners(tmp_path: Path) -> None:
    base = {"listen": "127.0.0.1:0", "data_dir": tmp_path, "mem_budget": 1 << 20,
            "disk_budget": 1 << 20, "node_id": "n"}
    assert DaemonConfig(**base).metrics_bind() == ("127.0.0.1", 0)  # type: ignore[arg-type]
    assert DaemonConfig(**base, metrics_listen="off").metrics_bind() is None  # type: ignore[arg-type]
    assert DaemonConfig(**base, metrics_listen="127.0.0.1:9400"  # type: ignore[arg-type]
                        ).metrics_bind() == ("127.0.0.1", 9400)
    with pytest.raises(ConfigError, match="loopback"):
        DaemonConfig(**base, metrics_listen="0.0.0.0:9400")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="HOST:PORT"):
        DaemonConfig(**base, metrics_listen="9400")  # type: ignore[arg-type]
    tokens = tmp_path / "tokens"
    tokens.write_text("t0k3n *\n")
    assert DaemonConfig(**base, metrics_listen="0.0.0.0:9400",  # type: ignore[arg-type]
                        token_file=tokens).metrics_bind() == ("0.0.0.0", 9400)


def test_a_taken_metrics_port_stops_the_daemon_with_a_clear_error(tmp_path: Path) -> None:
    holder = start_daemon(tmp_path, "holder", extra=["--metrics-listen", "127.0.0.1:0"])
    try:
        port = int(re.findall(r"metrics on http://127\.0\.0\.1:(\d+)", holder.log_text())[0])
        second = start_daemon(tmp_path, "second", wait=False,
                              extra=["--metrics-listen", f"127.0.0.1:{port}"])
        assert second.proc is not None
        assert second.proc.wait(30) == 2
        assert f"cannot serve metrics on 127.0.0.1:{port}" in second.log_text()
    finally:
        holder.terminate()


def test_rereplication_and_peers_are_exported(tmp_path: Path, etcd_server: EtcdServer) -> None:
    with running_daemons(tmp_path, 2, etcd_url=etcd_server.url, rereplicate_after=0.5,
                         extra=["--metrics-listen", "127.0.0.1:0"]) as (d0, d1):
        urls = [re.findall(r"metrics on (http://\S+/metrics)", d.log_text())[0]
                for d in (d0, d1)]
        for url, peer in zip(urls, ("d1", "d0"), strict=True):
            m = wait_for_sample(url, lambda s, p=peer: s.value("kvkeep_daemon_peer_up", peer=p)
                                == 1 and s.value("kvkeep_daemon_rereplication_passes_total")
                                >= 1)
            assert m.value("kvkeep_daemon_rereplication_pending_seconds") == 0
        # Blocks put on d0 alone; a third daemon joins: d0 pushes the copies it now owes.
        client = DaemonClient("d0", d0.address)
        assert _put(client, 0, 30) == [True] * 30
        client.close()
        d2 = start_daemon(tmp_path, "d2", etcd_url=etcd_server.url, rereplicate_after=0.5,
                          extra=["--metrics-listen", f"127.0.0.1:{free_port()}"])
        try:
            # Repairs are counted as each put returns, the pass's checked blocks at its end.
            m = wait_for_sample(urls[0], lambda s: s.value("kvkeep_daemon_repaired_blocks_total")
                                > 0 and s.value("kvkeep_daemon_peer_up", peer="d2") == 1
                                and s.value("kvkeep_daemon_rereplication_checked_blocks") == 30,
                                timeout=60)
            assert m.value("kvkeep_daemon_rereplication_checked_blocks") == 30
            assert m.value("kvkeep_daemon_rereplication_pending_seconds") == 0
            # d2 dies: until it leaves etcd (its lease) and a pass runs, d0 says so.
            d2.kill()
            wait_for_sample(urls[0], lambda s: "d2" not in s.label_values(
                "kvkeep_daemon_peer_up", "peer"), timeout=30)
        finally:
            d2.terminate()
