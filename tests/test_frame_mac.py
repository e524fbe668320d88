"""Signed frames (issue 13 item 4): a tenant's MAC key makes frames that only its writers can
make, and a reader holding it refuses every other frame, however well it verifies.

Units on the frame format, then a real daemon whose disk is rewritten under it (as a
compromised daemon or disk would): the rewritten blocks verify their checksums and are still
caught by the MAC. The connector's side (a real vLLM engine refusing a frame forged with the
tenant's token) is tests/test_connector_mac.py.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from deploy.local.daemons import DaemonProcess, running_daemon
from kvstore import frame as frame_module
from kvstore.block import decode_layers, encode_block
from kvstore.errors import ConfigError, CorruptBlock, ForgedBlock
from kvstore.frame import (
    BlockRead,
    FrameHeader,
    LayerRange,
    checked_frame,
    signed_segment_checksum,
    verify_pieces,
)
from kvstore.mac import MacKey, verify_mac
from kvstore.store import TieredStore
from kvstore.tiers.memory.host import HostTier
from kvstore.tiers.nvme.tier import NvmeTier
from kvstore.tiers.remote.tier import RemoteConfig, RemoteTier
from tests.blockframes import block_key

KEY = MacKey(bytes(range(32)))
OTHER = MacKey(bytes(range(1, 33)))


def layers(shape: tuple[int, ...], count: int, seed: int, dtype: str = "float16"
           ) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape).astype(dtype) for _ in range(count)]


def signed_block(i: int, *, codec: str = "raw", shape: tuple[int, ...] = (2, 16, 4, 32),
                 count: int = 4, signer: MacKey | None = KEY) -> bytes:
    return encode_block(layers(shape, count, i), codec=codec, key=block_key(i), token_count=16,
                        layout_id="nhd", compression="none", signer=signer)


def rewrite_segment(frame: bytes, layer: int = 0) -> bytes:
    """What an adversary who can write the bytes does: change a segment, recompute its BLAKE3
    checksum and the header's own checksum, keep the MAC it cannot recompute."""
    header = FrameHeader.unpack(frame)
    info = header.segments[layer]
    data = bytearray(frame)
    data[info.offset] ^= 0x40
    segments = list(header.segments)
    segments[layer] = info._replace(checksum=signed_segment_checksum(
        bytes(data[info.offset:info.offset + info.length])))
    forged = dataclasses.replace(header, segments=tuple(segments))
    return forged.pack() + bytes(data[header.header_size:])


@pytest.mark.parametrize(("codec", "shape", "count"), [("raw", (2, 16, 4, 32), 4),
                                                       ("int8", (2, 32, 8, 64), 3),
                                                       ("raw", (8, 64, 16), 28)])
def test_signed_frames_verify_and_decode_with_or_without_the_key(
        codec: str, shape: tuple[int, ...], count: int) -> None:
    frame = signed_block(3, codec=codec, shape=shape, count=count)
    read = BlockRead.from_frame(frame)
    assert read.header.signed and read.header.mac_key_id == KEY.key_id
    assert read.header.pack() == frame[:read.header.header_size]  # round trips exactly
    verify_mac(read.header, KEY)
    checked_frame(frame, block_key(3).digest, segments=True)
    verify_pieces(read.header, read.header.all_layers, [read.payload[:7], read.payload[7:]])
    # A reader without a key decodes it as any frame (and still catches a flipped bit).
    decoded = decode_layers(read, key=block_key(3))
    assert len(decoded) == count
    if codec == "raw":
        for got, want in zip(decoded, layers(shape, count, 3), strict=True):
            assert np.array_equal(got.view(np.float16), want)
    bad = bytearray(frame)
    bad[-1] ^= 1
    with pytest.raises(CorruptBlock):
        BlockRead.from_frame(bytes(bad)).verify()
    # Unsigned frames stay readable without a key, as before.
    old = BlockRead.from_frame(signed_block(3, codec=codec, shape=shape, count=count,
                                            signer=None))
    assert not old.header.signed
    old.verify()


def test_a_reader_with_the_key_refuses_every_frame_its_writers_did_not_sign() -> None:
    good = signed_block(1)
    verify_mac(FrameHeader.unpack(good), KEY)
    forgeries = {
        "unsigned": signed_block(1, signer=None),  # what a holder of the token writes
        "another key": signed_block(1, signer=OTHER),
        "a segment rewritten": rewrite_segment(good),
        "a later segment rewritten": rewrite_segment(good, layer=3),
        "the header rewritten": dataclasses.replace(
            FrameHeader.unpack(good), token_count=15).pack() + good[
                FrameHeader.unpack(good).header_size:],
        "the MAC of another block": dataclasses.replace(
            FrameHeader.unpack(other := signed_block(2)),
            mac=FrameHeader.unpack(good).mac).pack() + other[FrameHeader.unpack(other)
                                                             .header_size:],
    }
    for what, forged in forgeries.items():
        read = BlockRead.from_frame(forged)
        read.verify()  # each is a well-formed frame whose checksums verify ...
        with pytest.raises(ForgedBlock):  # ... and none has a valid MAC under the key
            verify_mac(read.header, KEY)
        assert what


def test_mac_keys_from_files(tmp_path: Path) -> None:
    hex_file = tmp_path / "hex"
    hex_file.write_text(bytes(range(32)).hex() + "\n")
    raw_file = tmp_path / "raw"
    raw_file.write_bytes(bytes(range(32)))
    assert MacKey.from_file(hex_file).key_id == MacKey.from_file(raw_file).key_id == KEY.key_id
    assert bytes(range(32)).hex() not in repr(KEY) and str(bytes(range(32))) not in repr(KEY)
    short = tmp_path / "short"
    short.write_text("abcd")
    with pytest.raises(ConfigError):
        MacKey.from_file(short)
    # A passphrase of any length is refused (trust review L8): only hex or raw random bytes.
    for phrase in ("correct horse battery staple 1234", "p" * 80, bytes(range(32)).hex()[:63]):
        (tmp_path / "phrase").write_text(phrase + "\n")
        with pytest.raises(ConfigError, match="passphrase"):
            MacKey.from_file(tmp_path / "phrase")
    with pytest.raises(ConfigError):
        MacKey.from_file(tmp_path / "missing")


def test_signed_reads_are_hashed_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = frame_module.signed_segment_checksum

    def counting(data: bytes | bytearray | memoryview) -> bytes:
        calls.append(len(data))
        return real(data)

    monkeypatch.setattr(frame_module, "signed_segment_checksum", counting)
    store = TieredStore([HostTier(16 << 20), NvmeTier(tmp_path / "nvme", 64 << 20)])
    try:
        frames = {block_key(i): signed_block(i) for i in range(3)}
        for key, frame in frames.items():
            assert store.put(key, frame)
        assert store.flush(10)
        calls.clear()
        for key in frames:
            read = store.get(key, LayerRange(1, 3))
            assert read is not None and read.verified
            verify_mac(read.header, KEY)
            decode_layers(read, key=key)
        assert len(calls) == 3 * 2  # one hash per segment read, none again in decoding
    finally:
        store.close()


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[DaemonProcess]:
    with running_daemon(tmp_path, "mac", mem_budget="8MiB") as proc:
        yield proc


def _block_file(daemon: DaemonProcess, i: int) -> Path:
    (path,) = [p for p in daemon.data_dir.rglob(f"{block_key(i).storage_name}*") if p.is_file()]
    return path


def test_a_block_rewritten_on_the_daemons_disk_is_caught(daemon: DaemonProcess) -> None:
    def tier() -> RemoteTier:
        return RemoteTier.from_addresses({daemon.node_id: daemon.address},
                                         RemoteConfig(replicas=1, extra_ranks=0))

    writer = tier()
    frames = {i: signed_block(i) for i in range(4)}
    try:
        for i, frame in frames.items():
            assert writer.put(block_key(i), frame)
    finally:
        writer.close()
    daemon.terminate()  # drained: every block is on disk
    # The disk (or whoever holds the daemon) rewrites blocks, each a frame that verifies.
    _block_file(daemon, 0).write_bytes(rewrite_segment(frames[0]))
    _block_file(daemon, 1).write_bytes(signed_block(1, signer=None))
    _block_file(daemon, 2).write_bytes(signed_block(2, signer=OTHER))
    daemon.spawn()
    daemon.wait_healthy()
    reader = tier()
    try:
        for i in range(4):
            read = reader.get(block_key(i))
            assert read is not None, i
            assert read.verified  # the checksums and the key binding all pass ...
            if i == 3:
                verify_mac(read.header, KEY)  # the block left alone is its writer's
                assert read.to_frame() == frames[3]
            else:
                with pytest.raises(ForgedBlock):  # ... and the MAC catches the rest
                    verify_mac(read.header, KEY)
    finally:
        reader.close()
    assert os.path.getsize(_block_file(daemon, 3)) == len(frames[3])
