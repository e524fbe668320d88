"""gRPC keepalive agrees on both ends: an idle client channel that pings as agreed is never sent
GOAWAY `too_many_pings`, while one that pings more often than its daemon permits is (the
control, so that the first check can fail). Real daemons (in this process, loopback), real
channels; the keepalive interval is shortened to gRPC's minimum (1 s) to keep this short."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from kvstore.daemon.config import DaemonConfig
from kvstore.daemon.server import Daemon
from kvstore.errors import ConfigError
from kvstore.net.daemon_client import DaemonClient
from kvstore.net.grpc_options import Keepalive, channel_options, server_options

FAST = Keepalive(interval_ms=1000, timeout_ms=1000)
IDLE_S = 5.0  # five pings from a client pinging every second; two early ones are struck


@contextlib.contextmanager
def daemon(tmp: Path, keepalive: Keepalive) -> Iterator[Daemon]:
    config = DaemonConfig(listen="127.0.0.1:0", data_dir=tmp, mem_budget=16 << 20,
                          disk_budget=64 << 20, node_id=tmp.name, data_listen="off",
                          keepalive=keepalive)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def start() -> Daemon:
        d = Daemon(config)
        await d.start()
        return d

    d = asyncio.run_coroutine_threadsafe(start(), loop).result(30)
    try:
        yield d
    finally:
        asyncio.run_coroutine_threadsafe(d.stop(), loop).result(60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


class Watched:
    """A client channel with its connectivity history."""

    def __init__(self, address: str, keepalive: Keepalive) -> None:
        self.channel = grpc.insecure_channel(address, options=channel_options(keepalive))
        self.states: list[grpc.ChannelConnectivity] = []
        self.channel.subscribe(self.states.append, try_to_connect=True)
        grpc.channel_ready_future(self.channel).result(timeout=10)

    def left_ready(self) -> bool:
        """Whether the connection was lost after it was first READY (a GOAWAY does that)."""
        ready = grpc.ChannelConnectivity.READY
        first = self.states.index(ready)
        return any(s is not ready for s in self.states[first + 1:])


def test_an_idle_channel_that_pings_as_agreed_is_not_goawayed(tmp_path: Path) -> None:
    (tmp_path / "agreed").mkdir()
    (tmp_path / "strict").mkdir()
    with daemon(tmp_path / "agreed", FAST) as agreed, \
            daemon(tmp_path / "strict", Keepalive()) as strict:
        good = Watched(f"127.0.0.1:{agreed.port}", FAST)
        # The control: a client pinging every second, its daemon permitting one ping per 5 s.
        eager = Watched(f"127.0.0.1:{strict.port}", FAST)
        time.sleep(IDLE_S)  # both idle: only keepalive pings cross the connections
        assert eager.left_ready(), "the control was not sent GOAWAY: the test cannot fail"
        assert not good.left_ready(), f"agreed keepalive lost its connection: {good.states}"
        client = DaemonClient("agreed", f"127.0.0.1:{agreed.port}", keepalive=FAST)
        try:
            assert client.health(timeout=5) == "SERVING"
        finally:
            client.close()
        good.channel.close()
        eager.channel.close()


def test_both_ends_derive_from_one_policy() -> None:
    for policy in (Keepalive(), FAST, Keepalive(interval_ms=30_000, timeout_ms=10_000)):
        client = dict(channel_options(policy))
        server = dict(server_options(policy))
        assert client["grpc.keepalive_time_ms"] == policy.interval_ms
        # The daemon permits pings at least twice as often as the client sends them.
        assert server["grpc.http2.min_ping_interval_without_data_ms"] * 2 <= policy.interval_ms
        assert server["grpc.keepalive_permit_without_calls"] == 1
        assert client["grpc.keepalive_permit_without_calls"] == 1
        for limit in ("grpc.max_send_message_length", "grpc.max_receive_message_length"):
            assert client[limit] == server[limit]
    with pytest.raises(ConfigError):
        Keepalive(interval_ms=100)  # below what gRPC clients send anyway
