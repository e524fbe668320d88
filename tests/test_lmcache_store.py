"""The kvkeep side of the LMCache plugin (connectors/lmcache/store.py and its parts) against real
kvstore daemons: round trips of objects of several sizes and scopes, skipping what is held, and
the failure semantics LMCache relies on: a dead daemon, a corrupt block, a refused token and
another tenant's objects are misses (or failed stores), never exceptions and never wrong bytes.
LMCache itself is not needed here; tests/test_lmcache_adapter.py covers the LMCache half."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from connectors.lmcache import keys as lmcache_keys
from connectors.lmcache.config import PluginSettings
from connectors.lmcache.frames import frame_size, matches_object, write_frame
from connectors.lmcache.install import install_stubs
from connectors.lmcache.keys import OBJECT_FORMAT, ObjectRef, ScopeMapper, block_hash_of, salt_name
from connectors.lmcache.store import ObjectStore
from deploy.local.daemons import DaemonProcess, running_daemons, start_daemon
from deploy.local.services import EtcdServer
from kvstore.errors import ConfigError, InvalidKey
from kvstore.frame import BlockRead
from kvstore.keys import Namespace

# Objects of one byte, one page, a typical LMCache chunk slice, and one that spans several
# 4 MiB wire chunks with an odd tail.
SIZES = (1, 4096, 256 << 10, (9 << 20) + 3)


def objects(n: int, size: int, *, model: str = "m/Llama-3", rank: int = 0, group: int = 0,
            salt: str = "", base: int = 0) -> tuple[list[ObjectRef], list[bytes]]:
    refs = [ObjectRef((base + i).to_bytes(32, "big"), model, rank, group, salt) for i in range(n)]
    data = [os.urandom(size) for _ in range(n)]
    return refs, data


def settings_for(daemons: list[DaemonProcess], **kw: object) -> PluginSettings:
    params: dict[str, object] = {"daemons": {d.node_id: d.address for d in daemons},
                                 "replicas": min(2, len(daemons)), "timeout_ms": 2000}
    params.update(kw)
    return PluginSettings.from_params(params)


def load_all(store: ObjectStore, refs: list[ObjectRef], sizes: list[int]
             ) -> tuple[list[bool], list[bytearray]]:
    outs = [bytearray(b"\xa5" * s) for s in sizes]
    return store.load(refs, outs), outs


@pytest.fixture(scope="module")
def two_daemons(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[DaemonProcess]]:
    with running_daemons(tmp_path_factory.mktemp("lmcache"), 2) as ds:
        yield ds


# -- units: keys, frames, settings -------------------------------------------------------------


def test_scopes_separate_model_rank_group_salt_and_revision() -> None:
    mapper = ScopeMapper("tenant-a")
    h = b"\x01" * 32
    base = ObjectRef(h, "m", 0, 0, "")
    variants = [base, ObjectRef(h, "m2", 0, 0, ""), ObjectRef(h, "m", 1, 0, ""),
                ObjectRef(h, "m", 0, 1, ""), ObjectRef(h, "m", 0, 0, "s")]
    digests = {mapper.key(v).digest for v in variants}
    digests.add(ScopeMapper("tenant-a", model_revision="r2").key(base).digest)
    digests.add(ScopeMapper("tenant-b").key(base).digest)
    assert len(digests) == 7
    assert mapper.key(base) == ScopeMapper("tenant-a").key(base)  # deterministic


def test_salts_map_injectively_to_valid_names() -> None:
    salts = ["", "alice", "user-abc_123.xyz", "user:42", "h.abc", "a" * 64, "a" * 65,
             "with space", "ünïcode", "h." + "0" * 48]
    names = [salt_name(s) for s in salts]
    assert len(set(names)) == len(salts)
    assert names[:3] == ["", "alice", "user-abc_123.xyz"]  # valid names pass through
    for name in names[1:]:
        Namespace("t", name)  # every mapped salt is a valid kvkeep salt


def test_chunk_hashes_are_kept_or_digested_with_rank_and_group_after() -> None:
    tail = (0).to_bytes(8, "big") + (0).to_bytes(4, "big")
    assert block_hash_of(b"\xde\xad\xbe\xef") == b"\xde\xad\xbe\xef" + tail + b"\x00"
    assert block_hash_of(b"\x01", 3, 2) == (b"\x01" + (3).to_bytes(8, "big")
                                            + (2).to_bytes(4, "big") + b"\x00")
    long_a, long_b = b"x" * 65 + b"a", b"x" * 65 + b"b"
    assert len(block_hash_of(long_a)) == 64 and block_hash_of(long_a) != block_hash_of(long_b)
    # One-to-one: a kept chunk hash never equals a digested one, whatever its bytes.
    digested = block_hash_of(b"y" * 52)
    assert block_hash_of(digested[:51]) != digested
    assert len({block_hash_of(b"z" * n) for n in range(1, 70)}) == 69
    for bad in [(b"",), (b"\x01", -1), (b"\x01", 1 << 64), (b"\x01", 0, 1 << 32)]:
        with pytest.raises(InvalidKey):
            block_hash_of(*bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidKey):
        ScopeMapper("t").key(ObjectRef(b"\x01", "", 0))


def test_ranks_and_groups_of_one_model_share_a_scope() -> None:
    """Rank and group go into the block hash, not the scope: a batch that mixes them (LMCache's
    benchmark gives every key its own kv_rank) is one request per daemon."""
    mapper = ScopeMapper("t")
    keys = [mapper.key(ObjectRef(b"\x01", "m", rank, group))
            for rank in range(4) for group in range(3)]
    assert len({(k.fingerprint, k.namespace) for k in keys}) == 1
    assert len({k.digest for k in keys}) == 12
    assert mapper.key(ObjectRef(b"\x01", "m2", 0)).fingerprint != keys[0].fingerprint


def test_remembered_keys_are_the_mapped_ones_and_bounded(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The mapper's memo gives exactly what mapping afresh gives, keeps at most
    MAPPED_KEYS_KEPT (oldest out first), and an unhashable chunk hash is mapped each time."""
    monkeypatch.setattr(lmcache_keys, "MAPPED_KEYS_KEPT", 4)
    mapper, fresh = ScopeMapper("t", "r"), ScopeMapper("t", "r")
    refs = [ObjectRef(bytes([i]) * 20, "m", i % 3, i % 2, "s" if i % 4 else "")
            for i in range(10)]
    for ref in refs + refs[::-1]:
        key = mapper.key(ref)
        assert key == fresh._map(ref) and key.digest == fresh._map(ref).digest
        assert len(mapper._keys) <= 4
    assert list(mapper._keys) == refs[3::-1]  # the last four mapped, in mapping order
    unhashable = ObjectRef(bytearray(b"\x07" * 20), "m", 1)  # type: ignore[arg-type]
    assert mapper.key(unhashable) == mapper.key(ObjectRef(b"\x07" * 20, "m", 1))
    writable = ObjectRef(memoryview(bytearray(b"\x07" * 20)), "m", 1)  # type: ignore[arg-type]
    assert mapper.key(writable) == mapper.key(unhashable)


def test_frame_of_an_object_verifies_and_is_bound_to_its_key() -> None:
    mapper = ScopeMapper("t")
    key, other = mapper.key(ObjectRef(b"\x01", "m", 0)), mapper.key(ObjectRef(b"\x02", "m", 0))
    data = os.urandom(1000)
    buf = memoryview(bytearray(frame_size(len(data)) + 16))
    n = write_frame(key, data, buf)
    read = BlockRead.from_frame(buf[:n])
    read.verify()
    read.verify_key(key.digest)
    assert read.header.layout_id == OBJECT_FORMAT and bytes(read.payload) == data
    assert matches_object(read, 1000) and not matches_object(read, 999)
    with pytest.raises(Exception, match="different key"):
        read.verify_key(other.digest)


def test_settings_refuse_typos_and_ambiguity(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown"):
        PluginSettings.from_params({"daemons": ["127.0.0.1:1"], "replica": 2})
    with pytest.raises(ConfigError, match="exactly one"):
        PluginSettings.from_params({"daemons": ["127.0.0.1:1"], "etcd": "http://x:1"})
    with pytest.raises(ConfigError, match="exactly one"):
        PluginSettings.from_params({})
    with pytest.raises(ConfigError, match="host:port"):
        PluginSettings.from_params({"daemons": ["nohost"]})
    with pytest.raises(ConfigError):
        PluginSettings.from_params({"daemons": ["127.0.0.1:1"], "tenant": "../etc"})
    listed = PluginSettings.from_params({"daemons": ["127.0.0.1:7400", "127.0.0.2:7400"],
                                         "timeout_ms": 250, "put_batch_mb": 8})
    assert listed.daemons == (("d0", "127.0.0.1:7400"), ("d1", "127.0.0.2:7400"))
    assert listed.timeout_s == 0.25 and listed.put_batch_bytes == 8 << 20
    empty = tmp_path / "token"
    empty.write_text("# no token here\n")
    with pytest.raises(ConfigError, match="no token"):
        ObjectStore.open(PluginSettings.from_params({"daemons": ["127.0.0.1:1"],
                                                     "token_file": str(empty)}))


# -- real daemons --------------------------------------------------------------------------------


@pytest.mark.parametrize("size", SIZES)
def test_round_trip_of_every_size(two_daemons: list[DaemonProcess], size: int) -> None:
    store = ObjectStore.open(settings_for(two_daemons, put_batch_mb=16))
    try:
        refs, data = objects(5, size, base=size)
        outcome = store.store(refs, data)
        assert outcome.ok and all(outcome.written)
        assert store.lookup(refs) == [True] * 5
        loaded, outs = load_all(store, refs, [size] * 5)
        assert loaded == [True] * 5
        assert [bytes(o) for o in outs] == data
    finally:
        store.close()


def test_batches_mix_scopes_and_misses(two_daemons: list[DaemonProcess]) -> None:
    store = ObjectStore.open(settings_for(two_daemons, put_batch_mb=1))
    try:
        a_refs, a_data = objects(3, 300_000, salt="alice", base=1000)
        b_refs, b_data = objects(3, 300_000, salt="user@example.com/x", rank=3, group=2,
                                 base=1000)
        refs, data = a_refs + b_refs, a_data + b_data
        assert store.store(refs, data).ok  # 1 MiB batches: several put calls
        missing, _ = objects(2, 300_000, salt="alice", base=5000)
        query = [refs[0], missing[0], refs[4], missing[1]]
        assert store.lookup(query) == [True, False, True, False]
        loaded, outs = load_all(store, query, [300_000] * 4)
        assert loaded == [True, False, True, False]
        assert bytes(outs[0]) == data[0] and bytes(outs[2]) == data[4]
        # Same chunk hashes under another salt, rank or group are other objects.
        assert store.lookup([ObjectRef(r.chunk_hash, r.model_name, r.kv_rank, 1, "bob")
                             for r in a_refs]) == [False] * 3
    finally:
        store.close()


def test_present_objects_are_not_sent_again(two_daemons: list[DaemonProcess]) -> None:
    store = ObjectStore.open(settings_for(two_daemons))
    clients = [d.client() for d in two_daemons]
    try:
        refs, data = objects(4, 100_000, base=2000)
        assert store.store(refs[:2], data[:2]).ok
        received = sum(c.stat(timeout=5).put_bytes_received for c in clients)
        outcome = store.store(refs, data)
        assert outcome.held == (True,) * 4 and outcome.written == (False, False, True, True)
        sent = sum(c.stat(timeout=5).put_bytes_received for c in clients) - received
        assert sent == 2 * 2 * frame_size(100_000)  # two new objects, two replicas each
        assert store.counters()["already_present"] == 2
    finally:
        store.close()


def test_wrong_sized_buffer_and_invalid_keys_are_misses(two_daemons: list[DaemonProcess]) -> None:
    store = ObjectStore.open(settings_for(two_daemons))
    try:
        refs, data = objects(2, 5000, base=3000)
        bad = ObjectRef(b"", "m", 0)
        outcome = store.store([refs[0], bad, refs[1]], [data[0], b"x", data[1]])
        assert outcome.held == (True, False, True) and not outcome.ok
        loaded, outs = load_all(store, [refs[0], refs[1], bad], [4999, 5000, 10])
        assert loaded == [False, True, False]
        assert bytes(outs[1]) == data[1]
        assert store.lookup([bad, refs[0]]) == [False, True]
        assert store.counters()["load_mismatched"] == 1
    finally:
        store.close()


def test_delete_reports_what_was_held(two_daemons: list[DaemonProcess]) -> None:
    store = ObjectStore.open(settings_for(two_daemons))
    try:
        refs, data = objects(3, 2000, base=4000)
        assert store.store(refs[:2], data[:2]).ok
        assert store.delete(refs) == [True, True, False]
        assert store.lookup(refs) == [False] * 3
        assert store.load(refs[:1], [bytearray(2000)]) == [False]
    finally:
        store.close()


def test_etcd_discovery(tmp_path: Path, etcd_server: EtcdServer) -> None:
    with running_daemons(tmp_path, 2, etcd_url=etcd_server.url):
        store = ObjectStore.open(PluginSettings.from_params(
            {"etcd": etcd_server.url, "replicas": 2}))
        try:
            refs, data = objects(3, 70_000, base=5000)
            assert store.store(refs, data).ok
            loaded, outs = load_all(store, refs, [70_000] * 3)
            assert loaded == [True] * 3 and [bytes(o) for o in outs] == data
            assert sorted(store.daemons()) == ["d0", "d1"]
        finally:
            store.close()


def test_a_dead_daemon_is_survived_then_all_dead_is_all_misses(tmp_path: Path) -> None:
    with running_daemons(tmp_path, 2) as daemons:
        store = ObjectStore.open(settings_for(daemons, timeout_ms=1000, lookup_timeout_ms=500))
        try:
            refs, data = objects(4, 50_000, base=6000)
            assert store.store(refs, data).ok
            daemons[0].kill()
            loaded, outs = load_all(store, refs, [50_000] * 4)
            assert loaded == [True] * 4 and [bytes(o) for o in outs] == data  # the replica
            daemons[1].kill()
            assert store.lookup(refs) == [False] * 4
            loaded, _ = load_all(store, refs, [50_000] * 4)
            assert loaded == [False] * 4
            more, more_data = objects(2, 50_000, base=7000)
            assert not store.store(more, more_data).ok
            assert not store.healthy()
            counts = store.counters()
            assert counts["load_hits"] == 4 and counts["load_misses"] == 4
        finally:
            store.close()


def test_a_corrupt_block_is_a_miss_never_wrong_bytes(tmp_path: Path) -> None:
    daemon = start_daemon(tmp_path, "solo")
    store = ObjectStore.open(settings_for([daemon], replicas=1))
    try:
        refs, data = objects(2, 40_000, base=8000)
        assert store.store(refs, data).ok
        key = ScopeMapper("default").key(refs[0])
        stat = daemon.client()
        deadline = time.monotonic() + 30
        while stat.stat(timeout=5).pending_writes and time.monotonic() < deadline:
            time.sleep(0.05)  # the daemon's write-behind to disk
        daemon.close_clients()
        daemon.terminate()
        (path,) = daemon.data_dir.glob(f"blocks/**/{key.digest.hex()}*")
        raw = bytearray(path.read_bytes())
        raw[-10] ^= 0xFF  # one payload bit; the header stays valid
        path.write_bytes(bytes(raw))
        daemon.spawn()  # its RAM copy is gone: reads come from the damaged file
        daemon.wait_healthy()
        deadline = time.monotonic() + 10
        while not store.healthy() and time.monotonic() < deadline:
            store.lookup(refs)  # the breaker opened while it was down: probe until it closes
            time.sleep(0.2)
        loaded, outs = load_all(store, refs, [40_000] * 2)
        assert loaded == [False, True]
        assert bytes(outs[1]) == data[1]
    finally:
        store.close()
        daemon.terminate()


def test_tokens_and_tenants(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("token-aaaaaaaaaaaa team-a\ntoken-bbbbbbbbbbbb team-b\n")
    files = {}
    for name, token in (("a", "token-aaaaaaaaaaaa"), ("b", "token-bbbbbbbbbbbb"),
                         ("bogus", "token-nope-nope-nope")):
        files[name] = tmp_path / f"{name}.token"
        files[name].write_text(f"# kvkeep\n{token}\n")
    daemon = start_daemon(tmp_path, "auth", token_file=tokens)
    addr = {"auth": daemon.address}

    def open_store(tenant: str, token: str | None) -> ObjectStore:
        params: dict[str, object] = {"daemons": addr, "replicas": 1, "tenant": tenant}
        if token is not None:
            params["token_file"] = str(files[token])
        return ObjectStore.open(PluginSettings.from_params(params))

    a = open_store("team-a", "a")
    others = [open_store("team-b", "b"),       # another tenant: its own namespace
              open_store("team-a", "b"),       # a token for another tenant: refused
              open_store("team-a", "bogus"),   # an unknown token: refused
              open_store("team-a", None)]      # no token: refused
    try:
        refs, data = objects(3, 30_000, base=9000)
        assert a.store(refs, data).ok
        for other in others:
            assert other.lookup(refs) == [False] * 3
            loaded, outs = load_all(other, refs, [30_000] * 3)
            assert loaded == [False] * 3
            assert all(bytes(o) != d for o, d in zip(outs, data, strict=True))
        for other in others[1:]:
            assert not other.store(refs[:1], data[:1]).ok
        assert others[0].store(refs[:1], [b"B" * 30_000]).ok  # team-b's own copy
        loaded, outs = load_all(a, refs, [30_000] * 3)
        assert loaded == [True] * 3 and [bytes(o) for o in outs] == data  # untouched
    finally:
        for s in [a, *others]:
            s.close()
        daemon.terminate()


def test_stubs_install_for_another_environment(tmp_path: Path) -> None:
    """The installer's overlay: `kvstore._proto` resolves to freshly generated stubs in a site
    dir (here with this venv's own grpcio-tools; `make bench-lmcache` does it under protobuf 6)."""
    site = tmp_path / "site"
    site.mkdir()
    package = install_stubs(site)
    assert (package / "proto_gen" / "kvstore_pb2.py").is_file()
    probe = ("import site, sys; site.addsitedir(sys.argv[1]);"
             "import kvstore._proto.kvstore_pb2 as pb; import connectors.lmcache.transport;"
             "import proto; print(pb.__file__); print(proto.__file__)")
    root = Path(__file__).resolve().parent.parent
    # A `proto` installed in that site (proto-plus, in LMCache's environment) keeps its name
    # beside kvkeep's stubs. (A stand-in package, not proto-plus.)
    (site / "proto").mkdir()
    (site / "proto" / "__init__.py").write_text("PLUS = True\n")
    done = subprocess.run([sys.executable, "-c", probe, str(site)], cwd=root, check=True,
                          capture_output=True, text=True)
    gen, top = (Path(line).resolve() for line in done.stdout.split())
    assert gen.is_relative_to(package.resolve())
    assert top == (site / "proto" / "__init__.py").resolve()
