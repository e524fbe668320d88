"""The remote tier over three real daemons (static membership): placement, acknowledgement
policies, read repair, circuit breakers and deadlines; plus unit tests of its small parts."""

from __future__ import annotations

import os
import signal
import time
from collections import Counter
from pathlib import Path

import pytest

from deploy.local.daemons import DaemonProcess, running_daemons
from deploy.local.processes import freeze
from deploy.local.services import free_port
from kvstore.errors import ConfigError, DeadlineExceeded
from kvstore.frame import BlockRead, LayerRange
from kvstore.keys import BlockKey
from kvstore.manifest import SessionManifest
from kvstore.net.daemon_client import DaemonClient
from kvstore.net.scope import scope_of
from kvstore.tiers.base import Tier
from kvstore.tiers.remote.placement import place, rank, rank_many
from kvstore.tiers.remote.resilience import BreakerState, CircuitBreaker, RetryPolicy
from kvstore.tiers.remote.tier import RemoteConfig, RemoteTier
from tests.blockframes import block_key, make_frame, session_key

T = 10.0


DAEMON_COUNT = 3


def make_tier(daemons: list[DaemonProcess], **config: object) -> RemoteTier:
    settings = {"replicas": 2, "call_timeout": 2.0, **config}
    return RemoteTier.from_addresses({d.node_id: d.address for d in daemons},
                                     RemoteConfig(**settings))  # type: ignore[arg-type]


def holders(daemons: list[DaemonProcess], key: BlockKey) -> set[str]:
    out = set()
    for d in daemons:
        c = DaemonClient(d.node_id, d.address)
        try:
            if c.lookup(scope_of(key), [key.block_hash], timeout=T) == [True]:
                out.add(d.node_id)
        finally:
            c.close()
    return out


# -- units ------------------------------------------------------------------------------------


def test_rendezvous_is_stable_and_moves_only_what_it_must() -> None:
    nodes = [f"n{i}" for i in range(5)]
    digests = [block_key(i).digest for i in range(2000)]
    before = [place(d, nodes, 2) for d in digests]
    assert before == [place(d, list(reversed(nodes)), 2) for d in digests]  # order-free
    assert rank_many(digests[:50], nodes, 2) == before[:50]
    load = Counter(n for owners in before for n in owners)
    assert max(load.values()) < 1.25 * min(load.values())  # balanced
    after = [place(d, nodes[:-1], 2) for d in digests]  # n4 leaves
    for old, new in zip(before, after, strict=True):
        if "n4" not in old:
            assert old == new  # untouched by the departure
        else:
            kept = [n for n in old if n != "n4"]
            assert new[: len(kept)] == kept or set(kept) <= set(new)
    assert rank(digests[0], []) == []


def test_retry_policy_and_breaker() -> None:
    policy = RetryPolicy(attempts=4, base_delay=0.01, max_delay=0.02, jitter=0.5)
    delays = list(policy.delays())
    assert len(delays) == 3 and all(0.005 <= d <= 0.02 for d in delays)
    assert not policy.sleep_within(1.0, time.monotonic() + 0.1)  # never sleeps past a deadline
    with pytest.raises(ConfigError):
        RetryPolicy(attempts=0)
    breaker = CircuitBreaker(failure_threshold=2, cooldown=0.1, max_cooldown=0.4)
    breaker.record_failure()
    assert breaker.allow()
    breaker.record_failure()
    assert breaker.state == BreakerState.OPEN and not breaker.allow()
    time.sleep(0.12)
    assert breaker.allow()  # the one probe
    assert not breaker.allow()  # no second probe while the first is out
    breaker.record_failure()  # failed probe: open again, longer
    time.sleep(0.12)
    assert not breaker.allow()
    time.sleep(0.1)
    assert breaker.allow()
    breaker.record_success()
    assert breaker.state == BreakerState.CLOSED and breaker.allow()


# -- against daemons --------------------------------------------------------------------------


def test_it_is_a_tier_and_places_two_copies(daemons: list[DaemonProcess]) -> None:
    tier = make_tier(daemons)
    try:
        assert isinstance(tier, Tier)
        keys = [block_key(i) for i in range(100, 130)]
        frames = {k: make_frame(k, layers=8, segment_bytes=2048) for k in keys}
        assert tier.put_many(list(frames.items())) == [True] * len(keys)
        for key in keys[:10]:
            assert holders(daemons, key) == set(tier.placement(key)[:2])
        assert tier.contains([*keys, block_key(1)]) == [True] * len(keys) + [False]
        for key, frame in frames.items():
            read = tier.get(key)
            assert read is not None and read.to_frame() == frame
            part = tier.get(key, LayerRange(3, 5))
            assert part is not None
            assert bytes(part.payload) == bytes(BlockRead.from_frame(frame, LayerRange(3, 5))
                                                .payload)
        assert tier.delete(keys[:5]) == 5
        assert tier.contains(keys[:5]) == [False] * 5
        key = session_key("remote-1")
        tier.put_manifest(SessionManifest(key, (keys[6].block_hash,), 16, generation=3))
        got = tier.get_manifest(key)
        assert got is not None and got.generation == 3
        assert tier.delete_manifest(key) and tier.get_manifest(key) is None
    finally:
        tier.close()


def test_ack_one_writes_the_other_copies_in_the_background(daemons: list[DaemonProcess]) -> None:
    tier = make_tier(daemons, write_ack="one")
    try:
        keys = [block_key(i) for i in range(200, 220)]
        assert tier.put_many([(k, make_frame(k)) for k in keys]) == [True] * len(keys)
        assert tier.flush(10)
        for key in keys:
            assert len(holders(daemons, key)) == 2
    finally:
        tier.close()


def test_a_manifest_read_repairs_its_owners_before_it_returns(
        daemons: list[DaemonProcess]) -> None:
    """An owner that lost a session's manifest (or holds an older one) has the newest again
    once the read returns, and the daemon that is no owner gets no copy. Repaired in the
    background instead, a repair could land after a delete that followed the read and bring
    the manifest back (the delete-then-read of the test above failed so in CI)."""
    tier = make_tier(daemons)
    by_id = {d.node_id: d for d in daemons}
    try:
        key = session_key("remote-repair")
        owners, other = tier.placement(key)[:2], tier.placement(key)[2]
        tier.put_manifest(SessionManifest(key, (b"blk",), 16, generation=4))

        def generations() -> dict[str, int | None]:
            out: dict[str, int | None] = {}
            for node in tier.placement(key):
                client = DaemonClient(node, by_id[node].address)
                try:
                    found = client.get_manifest(key, timeout=T)
                    out[node] = None if found is None else found.generation
                finally:
                    client.close()
            return out

        assert generations() == {owners[0]: 4, owners[1]: 4, other: None}
        lost = DaemonClient(owners[1], by_id[owners[1]].address)
        try:
            assert lost.delete_manifest(key, timeout=T)
        finally:
            lost.close()
        got = tier.get_manifest(key)
        assert got is not None and got.generation == 4
        assert generations() == {owners[0]: 4, owners[1]: 4, other: None}  # no wait needed
        assert tier.delete_manifest(key)
        assert tier.get_manifest(key) is None
        assert generations() == dict.fromkeys(tier.placement(key))
    finally:
        tier.close()


def test_read_repair_of_a_missing_and_a_corrupt_copy(daemons: list[DaemonProcess]) -> None:
    tier = make_tier(daemons)
    by_id = {d.node_id: d for d in daemons}
    try:
        # Missing: delete the primary's copy behind the tier's back.
        key = block_key(300)
        frame = make_frame(key, layers=4, segment_bytes=4096)
        assert tier.put(key, frame)
        primary = by_id[tier.placement(key)[0]]
        DaemonClient("x", primary.address).delete(scope_of(key), [key.block_hash], timeout=T)
        read = tier.get(key)
        assert read is not None and read.to_frame() == frame
        assert tier.flush(10)
        assert primary.node_id in holders(daemons, key)
        assert tier.counters().repairs >= 1

        # Corrupt on disk: flip a payload byte in the primary's file, restart it so its RAM
        # copy is gone; its store drops the bad copy, the tier reads the other and repairs.
        key = block_key(301)
        frame = make_frame(key, layers=4, segment_bytes=4096)
        assert tier.put(key, frame)
        primary = by_id[tier.placement(key)[0]]
        time.sleep(0.5)  # the write-behind to disk
        primary.terminate()
        (path,) = primary.data_dir.glob(f"blocks/**/{key.digest.hex()}*")
        data = bytearray(path.read_bytes())
        data[-10] ^= 0xFF
        path.write_bytes(bytes(data))
        primary.spawn()
        primary.wait_healthy()
        repairs = tier.counters().repairs
        deadline = time.monotonic() + 10
        read = None
        while time.monotonic() < deadline:  # the restarted daemon's breaker may need a probe
            read = tier.get(key)
            if read is not None and tier.flush(5) and tier.counters().repairs > repairs:
                break
            time.sleep(0.2)
        assert read is not None and read.to_frame() == frame
        good = DaemonClient("x", primary.address).get(scope_of(key), key.block_hash, timeout=T)
        assert good is not None and good.to_frame() == frame
    finally:
        tier.close()


def test_a_hung_daemon_costs_one_deadline_then_is_skipped(daemons: list[DaemonProcess]) -> None:
    # Written by one tier, read by a fresh one: a slow put on a loaded machine must not leave
    # the reader's breaker open before the daemon even hangs.
    writer = make_tier(daemons)
    by_id = {d.node_id: d for d in daemons}
    keys = [block_key(i) for i in range(400, 460)]
    frames = {k: make_frame(k) for k in keys}
    assert writer.put_many(list(frames.items())) == [True] * len(keys)
    writer.close()
    tier = make_tier(daemons, call_timeout=2.0, breaker_cooldown=60.0, breaker_max_cooldown=120.0)
    victim = by_id["d1"]
    led_by_victim = [k for k in keys if tier.placement(k)[0] == "d1"]
    assert len(led_by_victim) >= 5
    assert set(tier.breaker_states().values()) == {"closed"}
    assert victim.proc is not None
    freeze(victim.proc.pid)  # alive but silent: the worst kind of failure
    try:
        first = tier.get(led_by_victim[0], deadline=time.monotonic() + 30)
        assert first is not None and first.to_frame() == frames[led_by_victim[0]]
        # The hung daemon cost one timed-out call, then its breaker opened ...
        assert tier.counters().errors == 1
        assert tier.breaker_states()["d1"] == "open"
        # ... so every later read skips it without asking: no second timeout.
        for key in led_by_victim[1:]:
            read = tier.get(key)
            assert read is not None and read.to_frame() == frames[key]
        assert tier.counters().errors == 1
        assert tier.counters().skipped_open_breaker >= len(led_by_victim) - 1
        # Writes route around it too: each block still gets two copies, on live daemons.
        more = [block_key(i) for i in range(500, 510)]
        assert tier.put_many([(k, make_frame(k)) for k in more]) == [True] * len(more)
        assert tier.contains(more) == [True] * len(more)
        # A tight deadline on a key only the hung daemon could answer is a miss, not a hang.
        alone = make_tier([victim], call_timeout=5.0, breaker_cooldown=60.0,
                           breaker_max_cooldown=120.0)
        with pytest.raises(DeadlineExceeded):
            alone.get(led_by_victim[0], deadline=time.monotonic() + 1.0)
        assert alone.breaker_states() == {"d1": "open"}
        assert alone.get(led_by_victim[0]) is None  # its breaker is open now: instant miss
        assert alone.counters().skipped_open_breaker == 1
        alone.close()
    finally:
        os.kill(victim.proc.pid, signal.SIGCONT)
        tier.close()


def test_no_daemon_reachable_is_a_fast_miss() -> None:
    config = RemoteConfig(replicas=1, call_timeout=1.0, breaker_cooldown=60.0,
                          breaker_max_cooldown=120.0)
    tier = RemoteTier.from_addresses({"ghost": f"127.0.0.1:{free_port()}"}, config)
    try:
        key = block_key(1)
        assert tier.get(key) is None  # refused at once: one failure, and the breaker opens
        assert tier.breaker_states() == {"ghost": "open"}
        assert tier.contains([key]) == [False]
        assert tier.put(key, make_frame(key)) is False
        assert tier.counters().errors == 1  # the later calls did not dial it again
    finally:
        tier.close()


def test_refused_tokens_are_config_errors_not_misses(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("a-token-of-enough-length tenant-a\n")
    with running_daemons(tmp_path, 1, token_file=tokens) as (d,):
        tier = RemoteTier.from_addresses({d.node_id: d.address},
                                         RemoteConfig(replicas=1, token="wrong-token-000000000"))
        try:
            key = block_key(2)
            assert tier.get(key) is None  # a refusal is counted and reads as a miss ...
            assert tier.counters().errors >= 1
            with pytest.raises(ConfigError):  # ... but the client call itself says why
                DaemonClient(d.node_id, d.address, token="wrong-token-000000000").lookup(
                    scope_of(key), [key.block_hash], timeout=T)
        finally:
            tier.close()


def test_batched_reads_land_in_place_and_fall_back_per_key(daemons: list[DaemonProcess]) -> None:
    """`get_into`: one pipelined stream per daemon; each payload lands in its own buffer; a key
    its first daemon lacks is read from a replica (and repaired), an unknown key is None, and a
    hung daemon costs one deadline, then its keys come from the replicas."""
    writer = make_tier(daemons)
    by_id = {d.node_id: d for d in daemons}
    keys = [block_key(i) for i in range(700, 740)]
    frames = {k: make_frame(k, layers=2, segment_bytes=8192) for k in keys}
    assert writer.put_many(list(frames.items())) == [True] * len(keys)
    writer.close()
    tier = make_tier(daemons, call_timeout=2.0, breaker_cooldown=60.0, breaker_max_cooldown=120.0)
    try:
        lacking = keys[3]
        primary = by_id[tier.placement(lacking)[0]]
        DaemonClient("x", primary.address).delete(scope_of(lacking), [lacking.block_hash],
                                                  timeout=T)
        unknown = block_key(799)
        asked = [*keys, unknown]
        outs = [bytearray(2 * 8192) for _ in asked]
        outs[5] = bytearray(10)  # too small to land in: still read, into a buffer of its own
        reads = tier.get_into(asked, outs)
        assert reads[-1] is None
        for i, (key, read) in enumerate(zip(keys, reads[:-1], strict=True)):
            assert read is not None and read.to_frame() == frames[key]
            if i != 5:
                assert bytes(read.payload) == bytes(outs[i])  # landed in the caller's buffer
        assert tier.flush(10)
        assert primary.node_id in holders(daemons, lacking)  # read repair of the lacking copy

        victim = by_id["d2"]
        assert victim.proc is not None
        freeze(victim.proc.pid)
        try:
            reads = tier.get_into(keys, [None] * len(keys), deadline=time.monotonic() + 30)
            assert [r is not None and r.to_frame() == frames[k]
                    for k, r in zip(keys, reads, strict=True)] == [True] * len(keys)
            assert tier.breaker_states()["d2"] == "open"
            errors = tier.counters().errors
            reads = tier.get_into(keys, [None] * len(keys))  # skipped now: no second timeout
            assert all(r is not None for r in reads) and tier.counters().errors == errors
        finally:
            os.kill(victim.proc.pid, signal.SIGCONT)
    finally:
        tier.close()


def test_transports_can_be_chosen_before_the_first_block(daemons: list[DaemonProcess]) -> None:
    """A client whose first calls are lookups would send them over gRPC until a put or get
    picked the data plane; `choose_transports` picks it up front (LMCache's plugin does so on
    open), and an unreachable daemon is left to choose later."""
    dead = free_port()
    tier = RemoteTier.from_addresses({**{d.node_id: d.address for d in daemons},
                                      "gone": f"127.0.0.1:{dead}"}, RemoteConfig(replicas=2))
    try:
        assert set(tier.data_plane_addresses().values()) == {None}
        chosen = tier.choose_transports(timeout=2.0)
        assert chosen["gone"] is None
        assert all(chosen[d.node_id] is not None for d in daemons)
        keys = [block_key(i) for i in range(900, 910)]
        assert tier.contains(keys) == [False] * len(keys)  # and the tier still answers
    finally:
        tier.close()


def test_a_tiered_store_reads_a_batch_tier_by_tier(daemons: list[DaemonProcess]) -> None:
    """`TieredStore.get_many` over RAM and the daemons: keys the RAM tier lacks go to the
    daemons in one batched call (`get_into`), hits there are verified and promoted into RAM
    from the bytes already read (no block is read from a daemon twice), unknown keys are
    misses, counted as `get` counts them; a layer range reads per key."""
    from kvstore.store import TieredStore
    from kvstore.tiers.memory.host import HostTier

    writer = make_tier(daemons)
    remote_keys = [block_key(i) for i in range(1000, 1012)]
    frames = {k: make_frame(k, layers=4, segment_bytes=4096) for k in remote_keys}
    assert writer.put_many(list(frames.items())) == [True] * len(remote_keys)
    writer.close()
    remote = make_tier(daemons)
    batches: list[int] = []
    real_get_into = remote.get_into

    def counting(keys: list[BlockKey], outs: list[object], **kw: object) -> list[BlockRead | None]:
        batches.append(len(keys))
        return real_get_into(keys, outs, **kw)  # type: ignore[arg-type]

    remote.get_into = counting  # type: ignore[method-assign]
    single_gets: list[BlockKey] = []
    real_get = remote.get

    def counting_get(key: BlockKey, *args: object, **kw: object) -> BlockRead | None:
        single_gets.append(key)
        return real_get(key, *args, **kw)  # type: ignore[arg-type]

    remote.get = counting_get  # type: ignore[method-assign]
    store = TieredStore([HostTier(16 << 20), remote])
    try:
        local = block_key(1099)
        local_frame = make_frame(local, layers=4, segment_bytes=4096)
        assert store.tiers[0].put(local, local_frame)
        unknown = block_key(1098)
        keys = [local, *remote_keys, unknown]
        reads = store.get_many(keys)
        assert batches == [len(remote_keys) + 1]  # one batched call: 12 remote keys + unknown
        assert reads[0] is not None and reads[0].to_frame() == local_frame
        assert reads[-1] is None
        for key, read in zip(remote_keys, reads[1:-1], strict=True):
            assert read is not None and read.verified and read.to_frame() == frames[key]
        assert store.flush(10)
        assert store.tiers[0].contains(remote_keys) == [True] * len(remote_keys)  # promoted
        assert not set(single_gets) & set(remote_keys)  # ... from the frames read, not read again
        for key in remote_keys:
            promoted = store.tiers[0].get(key)
            assert promoted is not None and promoted.to_frame() == frames[key]
        stats = store.stats()
        assert stats.misses == 1
        # A layer range is read per key, from RAM now.
        part = store.get_many(remote_keys[:3], LayerRange(1, 3))
        assert all(r is not None and r.layers == LayerRange(1, 3) for r in part)
        assert batches == [len(remote_keys) + 1]
    finally:
        store.close()
