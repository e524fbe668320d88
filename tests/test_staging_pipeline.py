"""The staging pipelines (connectors/vllm/staging) on the host, with real threads, a real
tiered store (host RAM over nvme) and synthetic paged tensors of every layout, through the
connector's loader (`restore_path: "staged"`) and saver code.

On the host a lane's events are complete when its calls return, so what these tests pin is
the pipeline's logic, which is the same code on a GPU: batches through a ring of slots that is
never grown, back-pressure and cancellation, a block that is missing, corrupt (a bit flipped
in host RAM), forged or another engine's fails alone and is recomputed, nothing is written
after a cancel, and caches that hold frames verbatim are written in place: straight from the
host tier's pages, hashed once, with no slot and no store read in between.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import xxhash

from connectors.vllm.caches import PagedCaches
from connectors.vllm.config import RestorePath
from connectors.vllm.layouts import LayoutSpec
from connectors.vllm.loader import Loader
from connectors.vllm.metadata import BlockRun, LoadSpec
from connectors.vllm.outbox import WorkerOutbox
from connectors.vllm.staging import RestorePipeline, StagingConfig, writer_for
from connectors.vllm.staging.decode import DecodeWriter
from connectors.vllm.staging.frames import FrameLayout
from connectors.vllm.staging.in_place import InPlaceWriter
from connectors.vllm.staging.ring import Cancelled, StagingRing, split
from connectors.vllm.staging.ring_restore import RingWriter
from connectors.vllm.staging.save import (
    Framer,
    FrameSettings,
    HostFramer,
    Replicated,
    RingFramer,
    SaveBatch,
    Saved,
    SavePipeline,
    WriteBehind,
)
from connectors.vllm.stats import Count, Counts
from connectors.vllm.worker_context import WorkerContext
from deploy.local.daemons import running_daemons
from kvstore import frame
from kvstore.block import CompressionMode, decode_layer, encode_block
from kvstore.codecs import get_codec
from kvstore.errors import CodecError, ConfigError, InvalidFrame
from kvstore.frame import BlockRead, CodecId, Compression, DType, LayerRange, build_frame
from kvstore.keys import BlockKey, ModelFingerprint, Namespace
from kvstore.mac import MacKey
from kvstore.store import StoreConfig, TieredStore
from kvstore.tiers.base import Tier
from kvstore.tiers.memory.host import HostTier
from kvstore.tiers.nvme.tier import NvmeTier
from kvstore.tiers.remote.tier import RemoteConfig, RemoteTier

LAYERS, HEADS, HEAD_SIZE, BLOCK = 4, 2, 32, 8
NUM_BLOCKS = 40
PAGE = 1024  # small host pages: segments span pages, so lent blocks come in many pieces
LAYOUTS = {"verbatim": ("cpu-amx/raw", "cpu-raw"), "transposed": ("cpu/tnhd", "cpu-kt"),
           "flash": ("cuda/tnhd", "cuda")}


@pytest.fixture
def store(tmp_path: Path) -> Iterator[TieredStore]:
    tiers: list[Tier] = [HostTier(32 << 20, page_bytes=PAGE, arena_bytes=1 << 20),
             NvmeTier(tmp_path / "nvme", 64 << 20, durable=False, min_free_bytes=0)]
    with TieredStore(tiers, config=StoreConfig(promote=False, get_deadline_s=10.0)) as tiered:
        yield tiered


def _caches(layout: str, dtype: torch.dtype, codec: str) -> tuple[PagedCaches, ModelFingerprint]:
    layout_id, family = LAYOUTS[layout]
    spec = LayoutSpec(layout_id, family, HEADS, HEAD_SIZE, BLOCK)  # type: ignore[arg-type]
    fp = ModelFingerprint("m", "w", str(dtype).removeprefix("torch."), LAYERS, HEADS,
                          HEAD_SIZE, BLOCK, layout_id, codec)
    shape = ((2, NUM_BLOCKS, BLOCK, HEADS, HEAD_SIZE) if family == "cuda"
             else (NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD_SIZE))
    caches = PagedCaches(spec, LAYERS)
    caches.bind([torch.zeros(shape, dtype=dtype) for _ in range(LAYERS)])
    return caches, fp


def _frame(caches: PagedCaches, key: BlockKey, codec: str, gen: torch.Generator,
           layout_id: str | None = None, signer: MacKey | None = None) -> bytes:
    layers = [torch.randn(caches.block_shape, generator=gen).to(caches.torch_dtype)
              for _ in range(LAYERS)]
    return encode_block(layers, codec=codec, key=key, token_count=BLOCK,
                        layout_id=layout_id or caches.layout.layout_id, compression="none",
                        arrangement=caches.layout.arrangement, signer=signer)


def _expected(caches: PagedCaches, data: bytes, layer: int) -> torch.Tensor:
    out = torch.empty(caches.block_shape, dtype=caches.torch_dtype)
    return decode_layer(BlockRead.from_frame(data), layer, out=out)


def _restored(caches: PagedCaches, layer: int, block_id: int) -> torch.Tensor:
    return caches.bound[layer].gather(caches.tensors[layer], torch.tensor([block_id]))[0]


def _flip_in_host_pages(store: TieredStore, key: BlockKey, data: bytes, layer: int) -> None:
    """White box: a bit flips in RAM inside segment `layer`, behind the host tier's back."""
    host = store.tiers[0]
    assert isinstance(host, HostTier)
    at = BlockRead.from_frame(data).header.segments[layer].offset + 7
    entry = host._index[key.digest]
    host._page_views[entry.pages[at // PAGE]][at % PAGE] ^= 0x10


def _loader(store: TieredStore, caches: PagedCaches, fp: ModelFingerprint, codec: str,
            config: StagingConfig, *, first_layers: int = 0, deadline_s: float = 10.0,
            mac_key: MacKey | None = None, path: RestorePath = "staged"
            ) -> tuple[Loader, Counts, WorkerOutbox]:
    counters, outbox = Counts(), WorkerOutbox()
    context = WorkerContext(store, caches, fp, get_codec(codec).codec_id, outbox, counters,
                            mac_key)
    loader = Loader(context, deadline_s=deadline_s, first_layers=first_layers, path=path,
                    staging=config)
    return loader, counters, outbox


def _load(loader: Loader, targets: tuple[int, ...], hashes: list[bytes]) -> bool:
    loader.start([LoadSpec(BlockRun("r", "t", 0, targets, tuple(hashes)))])
    for layer in range(LAYERS):
        loader.wait_for_layer(layer)
    return loader.finish_step()


def _supported(caches: PagedCaches, codec: str) -> bool:
    try:
        get_codec(codec).check_layout(caches.block_shape, caches.dtype,
                                      caches.layout.arrangement)
    except CodecError:
        return False
    return True


@pytest.mark.parametrize("first_layers", [0, 1])
@pytest.mark.parametrize("codec", ["raw", "int8-sym", "int8-kivi"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_staged_restore_writes_what_frames_hold(store: TieredStore, layout: str,
                                                dtype: torch.dtype, codec: str,
                                                first_layers: int) -> None:
    caches, fp = _caches(layout, dtype, codec)
    if not _supported(caches, codec):
        pytest.skip(f"{codec} does not encode the {layout} layout")
    gen = torch.Generator().manual_seed(5)
    hashes = [bytes([i + 1]) * 32 for i in range(14)]
    keys = [BlockKey.of(fp, Namespace("t"), h) for h in hashes]
    frames = {key: _frame(caches, key, codec, gen) for key in keys}
    frames[keys[9]] = _frame(caches, keys[9], codec, gen, layout_id="another/layout")
    for i, key in enumerate(keys):
        if i != 4:  # block 4 is missing
            assert store.put(key, frames[key])
    assert store.flush(10)
    for i in (5, 6, 7):  # these only below the host tier: read (verified) by the nvme tier
        store.tiers[0].delete([keys[i]])
    store.tiers[1].delete([keys[1]])
    _flip_in_host_pages(store, keys[1], frames[keys[1]], LAYERS - 1)  # the last stage sees it
    segment = get_codec(codec).encoded_size(caches.block_shape, caches.dtype)
    # Slots of 3 whole blocks, 2 of them: batches reuse slots, and wait for them.
    config = StagingConfig(slots=2, slot_bytes=3 * LAYERS * segment, workers=3)
    loader, counters, outbox = _loader(store, caches, fp, codec, config,
                                       first_layers=first_layers)
    targets = (3, 7, 8, 12, 13, 20, 1, 2, 4, 5, 6, 9, 10, 22)
    try:
        assert not _load(loader, targets, hashes)
        pipeline = loader._pipeline
        assert pipeline is not None
        if isinstance(pipeline.writer, RingWriter):
            # host caches: one buffer per slot, made once
            assert pipeline.writer.ring.allocations == 2
        else:  # verbatim caches: no ring at all
            assert isinstance(pipeline.writer, InPlaceWriter)
    finally:
        loader.shutdown()
    snapshot = counters.snapshot()
    assert snapshot[Count.LOAD_MISSING] == 1
    assert snapshot[Count.LOAD_CORRUPT] == 1
    assert snapshot[Count.LOAD_MISMATCH] == 1
    assert snapshot[Count.LOADED_BLOCKS] == 11
    assert outbox.take_load_errors() == {targets[1], targets[4], targets[9]}
    assert store.get(keys[1]) is None and store.get(keys[9]) is None  # deleted
    for i, (key, block_id) in enumerate(zip(keys, targets, strict=True)):
        if i in (1, 4, 9):
            continue
        for layer in range(LAYERS):
            assert torch.equal(_restored(caches, layer, block_id),
                               _expected(caches, frames[key], layer)), (i, layer)
    untouched = sorted(set(range(NUM_BLOCKS)) - set(targets))
    for layer in range(LAYERS):
        assert not caches.bound[layer].gather(caches.tensors[layer],
                                              torch.tensor(untouched)).any()


def test_verbatim_host_caches_are_written_in_place(store: TieredStore,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's CPU cache with frames verbatim (raw): each block goes from the host tier's pages
    into its paged block, hashed once where it lies; no slot, no store read (which would copy
    it out first)."""
    caches, fp = _caches("verbatim", torch.bfloat16, "raw")
    gen = torch.Generator().manual_seed(8)
    hashes = [bytes([i + 1]) * 32 for i in range(9)]
    keys = [BlockKey.of(fp, Namespace("t"), h) for h in hashes]
    frames = {key: _frame(caches, key, "raw", gen) for key in keys}
    for key in keys:
        assert store.put(key, frames[key])
    assert store.flush(10)
    store.tiers[0].delete([keys[8]])  # one from the nvme tier: a verified read, copied once
    hashed: list[int] = []
    real_checksum, real_stream = frame.segment_checksum, xxhash.xxh3_128

    def counting(data: Any) -> bytes:
        hashed.append(len(data))
        return bytes(real_checksum(data))

    class CountingStream:
        def __init__(self) -> None:
            self._hasher = real_stream()
            hashed.append(0)

        def update(self, data: Any) -> None:
            hashed[-1] += len(data)
            self._hasher.update(data)

        def digest(self) -> bytes:
            return bytes(self._hasher.digest())

    def no_slots(*_: object) -> None:
        raise AssertionError("a staging slot was taken")

    reads: list[int] = []
    real_get_many = store.get_many

    def get_many(keys_: list[BlockKey], *args: Any, **kwargs: Any) -> Any:
        reads.append(len(keys_))
        return real_get_many(keys_, *args, **kwargs)

    config = StagingConfig(slots=2, slot_bytes=1 << 16, workers=2)
    loader, counters, _ = _loader(store, caches, fp, "raw", config)
    targets = tuple(range(30, 39))
    try:
        monkeypatch.setattr(StagingRing, "try_acquire", no_slots)
        monkeypatch.setattr(StagingRing, "acquire", no_slots)
        monkeypatch.setattr(frame, "segment_checksum", counting)
        monkeypatch.setattr(xxhash, "xxh3_128", CountingStream)
        monkeypatch.setattr(store, "get_many", get_many)
        assert _load(loader, targets, hashes)
    finally:
        loader.shutdown()
    assert counters.snapshot()[Count.LOADED_BLOCKS] == 9
    assert reads == [1]  # only the block the host tier did not hold
    segment = get_codec("raw").encoded_size(caches.block_shape, caches.dtype)
    # every segment hashed exactly once: 8 lent blocks where they lie, 1 by the nvme tier
    assert sum(hashed) == 9 * LAYERS * segment
    for key, block_id in zip(keys, targets, strict=True):
        for layer in range(LAYERS):
            assert torch.equal(_restored(caches, layer, block_id),
                               _expected(caches, frames[key], layer))


def test_trusted_host_pages_are_not_hashed_again(store: TieredStore,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """`trust_host_pages`: a block verified when it entered the host tier is restored with
    no hash at all (the trade: a bit flipped in RAM since then goes unseen)."""
    caches, fp = _caches("flash", torch.float16, "raw")
    gen = torch.Generator().manual_seed(9)
    hashes = [bytes([i + 1]) * 32 for i in range(5)]
    keys = [BlockKey.of(fp, Namespace("t"), h) for h in hashes]
    frames = {key: _frame(caches, key, "raw", gen) for key in keys}
    for key in keys:
        assert store.put(key, frames[key])

    def no_hash(_: object) -> bytes:
        raise AssertionError("hashed")

    loader, counters, _ = _loader(store, caches, fp, "raw",
                                  StagingConfig(slots=2, slot_bytes=1 << 16,
                                                trust_host_pages=True))
    try:
        monkeypatch.setattr(frame, "segment_checksum", no_hash)
        assert _load(loader, (1, 2, 3, 4, 5), hashes)
    finally:
        loader.shutdown()
    assert counters.snapshot()[Count.LOADED_BLOCKS] == 5
    for key, block_id in zip(keys, (1, 2, 3, 4, 5), strict=True):
        assert torch.equal(_restored(caches, 2, block_id), _expected(caches, frames[key], 2))


@pytest.mark.parametrize("layout", ["verbatim", "flash"])
def test_signed_frames_need_the_tenant_key(store: TieredStore, layout: str) -> None:
    """With a MAC key the staged path refuses frames signed by anyone else (forged) and
    restores its own (BLAKE3 segment checksums, hashed where they lie)."""
    caches, fp = _caches(layout, torch.bfloat16, "raw")
    ours, theirs = MacKey(b"k" * 32), MacKey(b"x" * 32)
    gen = torch.Generator().manual_seed(10)
    hashes = [bytes([i + 1]) * 32 for i in range(4)]
    keys = [BlockKey.of(fp, Namespace("t"), h) for h in hashes]
    frames = {key: _frame(caches, key, "raw", gen, signer=theirs if i == 2 else ours)
              for i, key in enumerate(keys)}
    for key in keys:
        assert store.put(key, frames[key])
    loader, counters, outbox = _loader(store, caches, fp, "raw",
                                       StagingConfig(slots=2, slot_bytes=1 << 16),
                                       mac_key=ours)
    try:
        assert not _load(loader, (11, 12, 13, 14), hashes)
    finally:
        loader.shutdown()
    assert counters.snapshot()[Count.LOAD_FORGED] == 1
    assert counters.snapshot()[Count.LOADED_BLOCKS] == 3
    assert outbox.take_load_errors() == {13}
    assert not any(t.any() for t in (caches.bound[0].gather(caches.tensors[0],
                                                            torch.tensor([13])),))
    assert torch.equal(_restored(caches, 3, 14), _expected(caches, frames[keys[3]], 3))


@pytest.mark.parametrize("layout", ["verbatim", "transposed"])
def test_a_late_staged_restore_writes_nothing(store: TieredStore, layout: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    caches, fp = _caches(layout, torch.bfloat16, "raw")
    gen = torch.Generator().manual_seed(4)
    key = BlockKey.of(fp, Namespace("t"), b"\x07" * 32)
    assert store.put(key, _frame(caches, key, "raw", gen))
    release = threading.Event()
    real_borrow = store.borrow

    def slow_borrow(*args: Any, **kwargs: Any) -> Any:
        release.wait(5)
        return real_borrow(*args, **kwargs)

    monkeypatch.setattr(store, "borrow", slow_borrow)
    loader, counters, _ = _loader(store, caches, fp, "raw",
                                  StagingConfig(slots=2, slot_bytes=1 << 16), deadline_s=0.2)
    try:
        loader.start([LoadSpec(BlockRun("r", "t", 0, (6,), (b"\x07" * 32,)))])
        loader.wait_for_layer(0)  # times out at the deadline and cancels the job
        release.set()
        assert not loader.finish_step()
        time.sleep(0.2)  # the loader thread, released, finds the job cancelled
    finally:
        loader.shutdown()
    assert counters.snapshot()[Count.LOAD_LATE] == 1
    assert not any(t.any() for t in caches.tensors)


# -- the save pipeline -------------------------------------------------------------------------

def _save_pipeline(caches: PagedCaches, store: TieredStore, codec: str, framing: str, *,
                   compression: CompressionMode = "none", signer: MacKey | None = None,
                   staging: StagingConfig | None = None) -> SavePipeline:
    settings = FrameSettings(get_codec(codec).codec_id, compression, signer)
    framer: Framer = (RingFramer(caches, settings, staging) if framing == "staged"
                      else HostFramer(caches, settings))
    return SavePipeline(framer, WriteBehind(store))


def _save(pipeline: SavePipeline, keys: list[BlockKey], layers: list[torch.Tensor],
          rows: list[int] | None = None) -> dict[int, bool]:
    reports: dict[int, bool] = {}
    lock = threading.Lock()

    def report(index: int, saved: Saved) -> None:
        with lock:
            assert index not in reports
            reports[index] = saved.stored

    batch = SaveBatch(keys, layers, list(range(len(keys))) if rows is None else rows)
    pipeline.save(batch, report)
    return reports


@pytest.mark.parametrize("codec", ["raw", "int8-sym", "int8-kivi"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_staged_save_frames_read_back(store: TieredStore, layout: str, codec: str) -> None:
    """Frames sealed in place are ordinary frames: raw ones byte for byte what `encode_block`
    writes, lossy ones decode within the codec's error; then a staged restore puts them
    back into another engine's cache."""
    caches, fp = _caches(layout, torch.bfloat16, codec)
    if not _supported(caches, codec):
        pytest.skip(f"{codec} does not encode the {layout} layout")
    gen = torch.Generator().manual_seed(12)
    for tensor in caches.tensors:
        tensor.copy_(torch.randn(tensor.shape, generator=gen).to(tensor.dtype))
    ids = torch.tensor([4, 9, 2, 17, 30, 31, 5])
    hashes = [bytes([i + 1]) * 32 for i in range(len(ids))]
    keys = [BlockKey.of(fp, Namespace("t"), h) for h in hashes]
    segment = get_codec(codec).encoded_size(caches.block_shape, caches.dtype)
    pipeline = _save_pipeline(caches, store, codec, "staged", staging=StagingConfig(
        slots=2, slot_bytes=2 * (LAYERS * segment + 400)))
    layers = [caches.bound[i].gather(caches.tensors[i], ids) for i in range(LAYERS)]
    try:
        reports = _save(pipeline, keys, layers)
        assert isinstance(pipeline.framer, RingFramer)
        assert pipeline.framer.ring.allocations == 2 and pipeline.framer.ring.free == 2
    finally:
        pipeline.close()
    assert reports == dict.fromkeys(range(len(ids)), True)
    for j, key in enumerate(keys):
        read = store.get(key)
        assert read is not None and read.verified
        written = encode_block([layer[j] for layer in layers], codec=codec, key=key,
                               token_count=BLOCK, layout_id=caches.layout.layout_id,
                               compression="none", arrangement=caches.layout.arrangement)
        expected = BlockRead.from_frame(written).header
        assert (read.header.codec, read.header.dtype, read.header.layout_id,
                read.header.layer_shape, read.header.token_count) == (
            expected.codec, expected.dtype, expected.layout_id, expected.layer_shape,
            expected.token_count)
        if codec == "raw":
            assert read.to_frame() == written
    target, _ = _caches(layout, torch.bfloat16, codec)
    loader, _, _ = _loader(store, target, fp, codec, StagingConfig(slots=2, slot_bytes=1 << 16))
    try:
        assert _load(loader, tuple(int(i) for i in ids), hashes)
    finally:
        loader.shutdown()
    for layer in range(LAYERS):
        got = target.bound[layer].gather(target.tensors[layer], ids).float()
        want = layers[layer].float()
        if codec == "raw":
            assert torch.equal(got, want)
        else:
            assert (got - want).abs().max().item() <= 2 * want.abs().max().item() / 255


@pytest.mark.parametrize("signed", [False, True], ids=["unsigned", "signed"])
@pytest.mark.parametrize("compression", ["none", "zstd", "auto"])
@pytest.mark.parametrize("framing", ["auto", "staged"])
@pytest.mark.parametrize("codec", ["raw", "int8-kivi"])
def test_every_save_combination_writes_what_the_reader_restores(
        store: TieredStore, codec: str, framing: str, compression: CompressionMode,
        signed: bool) -> None:
    """One save pipeline for every setting: each framer, compressed or not, signed or not,
    writes frames that a loader holding the tenant's key (or none, unsigned) restores, and a
    loader with another key refuses. Raw frames are byte for byte what `encode_block` writes
    for the same settings (the reference encoder), whichever framer made them; only a subset
    of a batch's rows (those no tier holds yet) is saved."""
    caches, fp = _caches("flash", torch.bfloat16, codec)
    signer = MacKey(b"k" * 32) if signed else None
    gen = torch.Generator().manual_seed(3)
    for tensor in caches.tensors:
        # Repeated values, so that zstd finds something to save and "auto" compresses.
        tensor.copy_(torch.randint(-3, 3, tensor.shape, generator=gen).to(tensor.dtype))
    ids = torch.tensor([3, 8, 1, 22, 6])
    rows = [0, 2, 3, 4]  # row 1 is held elsewhere: not saved
    hashes = [bytes([i + 1]) * 32 for i in range(len(rows))]
    keys = [BlockKey.of(fp, Namespace("t"), h) for h in hashes]
    layers = [caches.bound[i].gather(caches.tensors[i], ids) for i in range(LAYERS)]
    pipeline = _save_pipeline(caches, store, codec, framing, compression=compression,
                              signer=signer, staging=StagingConfig(slots=2, slot_bytes=1 << 14))
    try:
        assert _save(pipeline, keys, layers, rows) == dict.fromkeys(range(len(rows)), True)
    finally:
        pipeline.close()
    for key, row in zip(keys, rows, strict=True):
        read = store.get(key)
        assert read is not None and read.header.signed == signed
        reference = encode_block([layer[row] for layer in layers], codec=codec, key=key,
                                 token_count=BLOCK, layout_id=caches.layout.layout_id,
                                 compression=compression, arrangement=caches.layout.arrangement,
                                 signer=signer)
        if compression != "none":
            assert any(segment.compression is Compression.ZSTD
                       for segment in read.header.segments)
        if codec == "raw" or framing == "auto":
            assert read.to_frame() == reference
    target_ids = (10, 11, 12, 13)
    for key_used, restores in ((signer, True), (MacKey(b"x" * 32), False)):
        target, _ = _caches("flash", torch.bfloat16, codec)
        loader, counters, _ = _loader(store, target, fp, codec, StagingConfig(slots=2),
                                      mac_key=key_used)
        try:
            assert _load(loader, target_ids, hashes) == restores
        finally:
            loader.shutdown()
        if not restores:
            assert counters.snapshot()[Count.LOAD_FORGED] > 0
            break
        for layer in range(LAYERS):
            got = target.bound[layer].gather(target.tensors[layer], torch.tensor(target_ids))
            want = layers[layer][torch.tensor(rows)]
            if codec == "raw":
                assert torch.equal(got, want)
            else:
                assert (got.float() - want.float()).abs().max().item() <= 0.1


@pytest.mark.parametrize("signed", [False, True], ids=["unsigned", "signed"])
@pytest.mark.parametrize("compression", ["none", "zstd"])
@pytest.mark.parametrize("path", ["auto", "device_decode", "staged"])
@pytest.mark.parametrize(("layout", "codec"), [("verbatim", "raw"), ("flash", "raw"),
                                               ("flash", "int8-kivi")])
def test_every_restore_path_restores_every_frame_setting(
        store: TieredStore, layout: str, codec: str, path: RestorePath,
        compression: CompressionMode, signed: bool) -> None:
    """One restore pipeline for every setting: each writer (decode, ring, in place) restores
    compressed and signed frames, from the host tier (lent in place where the writer
    borrows) and from the nvme tier below it, in two layer stages, to what the reference
    decoder gives."""
    caches, fp = _caches(layout, torch.bfloat16, codec)
    signer = MacKey(b"r" * 32) if signed else None
    gen = torch.Generator().manual_seed(21)
    hashes = [bytes([i + 1]) * 32 for i in range(6)]
    keys = [BlockKey.of(fp, Namespace("t"), h) for h in hashes]
    frames = {}
    for key in keys:
        layers = [torch.randint(-4, 4, caches.block_shape, generator=gen).to(torch.bfloat16)
                  for _ in range(LAYERS)]
        frames[key] = encode_block(layers, codec=codec, key=key, token_count=BLOCK,
                                   layout_id=caches.layout.layout_id, compression=compression,
                                   arrangement=caches.layout.arrangement, signer=signer)
        assert store.put(key, frames[key])
    assert store.flush(10)
    store.tiers[0].delete(keys[4:])  # these two from the nvme tier
    loader, counters, _ = _loader(store, caches, fp, codec,
                                  StagingConfig(slots=2, slot_bytes=1 << 14, workers=2),
                                  first_layers=1, mac_key=signer, path=path)
    targets = (7, 3, 12, 30, 1, 25)
    try:
        assert _load(loader, targets, hashes)
    finally:
        loader.shutdown()
    assert counters.snapshot()[Count.LOADED_BLOCKS] == len(keys)
    for key, block_id in zip(keys, targets, strict=True):
        for layer in range(LAYERS):
            assert torch.equal(_restored(caches, layer, block_id),
                               _expected(caches, frames[key], layer)), (key, layer)


@pytest.mark.parametrize("framing", ["auto", "staged"])
def test_durable_saves_through_either_framer_with_compression_and_a_mac(
        tmp_path: Path, framing: str) -> None:
    """`durability` is the replicated sink behind either framer: with two real daemons up,
    every block is stored and acknowledged by both; with one of them killed, blocks are still
    stored (they go behind) and reported not durable, never durable by mistake."""
    caches, fp = _caches("flash", torch.bfloat16, "raw")
    gen = torch.Generator().manual_seed(9)
    for tensor in caches.tensors:
        tensor.copy_(torch.randint(-3, 3, tensor.shape, generator=gen).to(tensor.dtype))
    ids = torch.tensor([2, 5, 7])
    layers = [caches.bound[i].gather(caches.tensors[i], ids) for i in range(LAYERS)]
    settings = FrameSettings(CodecId.RAW, "zstd", MacKey(b"d" * 32))
    with running_daemons(tmp_path, 2) as daemons:
        remote = RemoteTier.from_addresses({d.node_id: d.address for d in daemons},
                                           RemoteConfig(replicas=2, call_timeout=2.0,
                                                        breaker_cooldown=0.2))
        with TieredStore([HostTier(16 << 20, name="host"), remote]) as store:
            framer: Framer = (RingFramer(caches, settings, StagingConfig(slots=2))
                              if framing == "staged" else HostFramer(caches, settings))
            pipeline = SavePipeline(framer, Replicated(store, 2))
            try:
                for round_, alive in enumerate((2, 1)):
                    if alive == 1:
                        daemons[1].kill()
                    keys = [BlockKey.of(fp, Namespace("t"), bytes([round_ * 8 + i + 1]) * 32)
                            for i in range(len(ids))]
                    reports: dict[int, Saved] = {}
                    pipeline.save(SaveBatch(keys, layers, range(len(ids)),
                                            deadline=time.monotonic() + 3.0),
                                  reports.__setitem__)
                    assert reports == dict.fromkeys(range(len(ids)), Saved(True, alive == 2))
                    assert all(store.get(key) is not None for key in keys)
            finally:
                pipeline.close()


@pytest.mark.parametrize("framing", ["auto", "staged"])
def test_a_batch_that_cannot_be_encoded_is_reported_unsaved(store: TieredStore,
                                                            framing: str) -> None:
    caches, fp = _caches("flash", torch.bfloat16, "int8-kivi")
    layers = [torch.randn((3, *caches.block_shape)).to(torch.bfloat16) for _ in range(LAYERS)]
    layers[2][1].view(-1)[0] = float("inf")
    keys = [BlockKey.of(fp, Namespace("t"), bytes([i + 1]) * 32) for i in range(3)]
    pipeline = _save_pipeline(caches, store, "int8-kivi", framing)
    try:
        reports = _save(pipeline, keys, layers)
        if isinstance(pipeline.framer, RingFramer):
            assert pipeline.framer.ring.free == pipeline.framer.ring.capacity
    finally:
        pipeline.close()
    # The staged framer encodes a batch in one kernel sequence: the whole batch fails; the
    # host framer encodes block by block: only the block holding inf.
    assert reports == ({0: False, 1: False, 2: False} if framing == "staged"
                       else {0: True, 1: False, 2: True})
    assert [store.get(key) is not None for key in keys] == [reports[j] for j in range(3)]


def test_a_row_that_cannot_be_framed_fails_alone_and_every_slot_comes_back(
        store: TieredStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """A frame the staged framer cannot build (here: refused by the frame builder) is that
    block's NOT_SAVED; its batch's other blocks are saved and every slot returns to the ring,
    so the next batch never waits for a lost one."""
    caches, fp = _caches("flash", torch.bfloat16, "raw")
    ids = torch.arange(6)
    layers = [caches.bound[i].gather(caches.tensors[i], ids) for i in range(LAYERS)]
    keys = [BlockKey.of(fp, Namespace("t"), bytes([i + 1]) * 32) for i in range(6)]
    segment = get_codec("raw").encoded_size(caches.block_shape, caches.dtype)
    pipeline = _save_pipeline(caches, store, "raw", "staged", compression="zstd",
                              staging=StagingConfig(slots=2, slot_bytes=2 * (LAYERS * segment
                                                                             + 400)))
    framer = pipeline.framer
    assert isinstance(framer, RingFramer)
    real = framer._frame_row

    def refuse_the_fourth(row: Any, key: BlockKey) -> Any:
        if key == keys[3]:
            raise InvalidFrame("refused for the test")
        return real(row, key)

    monkeypatch.setattr(framer, "_frame_row", refuse_the_fourth)
    try:
        assert _save(pipeline, keys, layers) == {0: True, 1: True, 2: True, 3: False, 4: True,
                                                 5: True}
        assert framer.ring.free == framer.ring.capacity
        assert _save(pipeline, keys[:3], layers) == {0: True, 1: True, 2: True}
    finally:
        pipeline.close()


def test_a_saver_whose_pipeline_fails_reports_its_blocks_unsaved(
        store: TieredStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """An error inside the save pipeline (a bug, a device error) never reaches the engine's
    step: the batch's blocks are reported not saved (vLLM's scheduler plans them again) and
    counted as failed."""
    from connectors.vllm.config import ConnectorConfig
    from connectors.vllm.metadata import SaveSpec
    from connectors.vllm.saver import Saver

    caches, fp = _caches("flash", torch.bfloat16, "raw")
    counters, outbox = Counts(), WorkerOutbox()
    context = WorkerContext(store, caches, fp, CodecId.RAW, outbox, counters)
    saver = Saver(context, ConnectorConfig.from_extra({"store": {"host_bytes": 1 << 20}}))

    def broken(*_: Any) -> Any:
        raise RuntimeError("a device error")

    monkeypatch.setattr(WriteBehind, "put", broken)
    hashes = tuple(bytes([i + 1]) * 32 for i in range(3))
    try:
        saver.prepare()
        saver.finish_step([SaveSpec(BlockRun("r", "t", 0, (4, 5, 6), hashes), flush=True)],
                          loads_ok=True)
        assert saver.drain(10)
    finally:
        saver.shutdown()
    report = outbox.take_report()
    assert report is not None
    assert sorted((r.index, r.ok) for r in report.saves) == [(0, False), (1, False), (2, False)]
    assert counters.snapshot()[Count.SAVE_FAILED] == 3
    assert outbox.take_finished()[0] == {"r"}  # the paged blocks were let go all the same


@pytest.mark.parametrize("signed", [False, True])
def test_sealed_frames_are_build_frames_bytes(signed: bool) -> None:
    rng = np.random.default_rng(1)
    shape, layers, size = (2, 8, 2, 16), 3, 1024
    signer = MacKey(b"q" * 40) if signed else None
    layout = FrameLayout(CodecId.RAW, DType.BFLOAT16, "cuda/tnhd", 8, shape, layers, size,
                         signer=signer)
    segments = [rng.integers(0, 255, size, dtype=np.uint8).tobytes() for _ in range(layers)]
    row = np.zeros(layout.frame_bytes + 50, np.uint8)
    for i, data in enumerate(segments):
        start = layout.header_bytes + i * size
        row[start: start + size] = np.frombuffer(data, np.uint8)
    digest = bytes(range(16))
    sealed = layout.seal(row, digest)
    assert bytes(sealed) == build_frame([(s, Compression.NONE, size) for s in segments],
                                        codec=CodecId.RAW, dtype=DType.BFLOAT16,
                                        layout_id="cuda/tnhd", token_count=8,
                                        layer_shape=shape, key_digest=digest, signer=signer)
    assert layout.payload_span(LayerRange(1, 3)) == (size, 3 * size)


# -- the ring ------------------------------------------------------------------------------------

def test_ring_back_pressure_and_cancellation() -> None:
    ring = StagingRing(slots=2, slot_bytes=4096, device=torch.device("cpu"), pinned=False)
    first, second = ring.try_acquire(), ring.try_acquire()
    assert first is not None and second is not None and first is not second
    assert first.shared and ring.try_acquire() is None and ring.free == 0
    got: list[int] = []
    waiter = threading.Thread(target=lambda: got.append(ring.acquire(lambda: False).index))
    waiter.start()
    time.sleep(0.1)
    assert not got and ring.waits == 1  # blocked while every slot is out
    ring.release(second)
    waiter.join(2)
    assert got == [second.index]
    with pytest.raises(Cancelled):
        ring.acquire(lambda: True)
    ring.release(first)
    with pytest.raises(RuntimeError):
        ring.release(first)
    assert ring.allocations == 2  # nothing allocated after construction
    host, device = first.rows(3, 1000)
    assert host.shape == (3, 1000) and device.data_ptr() == host.data_ptr()
    with pytest.raises(ValueError):
        first.rows(5, 1000)


def test_split_and_config_bounds() -> None:
    assert split(10, 3) == [range(0, 4), range(4, 8), range(8, 10)]
    assert split(2, 4) == [range(0, 1), range(1, 2)]
    assert split(0, 4) == []
    with pytest.raises(ConfigError):
        StagingConfig(slots=1)
    with pytest.raises(ConfigError):
        StagingConfig(workers=0)


def test_restore_pipeline_builds_without_vllm(store: TieredStore) -> None:
    """benchmarks.gpu builds the pipelines on bound tensors alone (no vLLM); `writer_for`
    picks each writer from `restore_path` and the caches."""
    caches, _ = _caches("flash", torch.bfloat16, "raw")
    writer = writer_for(caches, store, CodecId.RAW, "staged", StagingConfig(slot_bytes=1))
    pipeline = RestorePipeline(store, writer, read=lambda *_: [], refusal=lambda _: None)
    try:
        assert isinstance(writer, RingWriter)
        # never below one block's whole frame payload
        assert writer.ring.slot_bytes == LAYERS * 2 * BLOCK * HEADS * HEAD_SIZE * 2
    finally:
        pipeline.close()
    verbatim, _ = _caches("verbatim", torch.bfloat16, "raw")
    for path, kind in (("auto", DecodeWriter), ("device_decode", DecodeWriter),
                       ("staged", InPlaceWriter)):
        chosen = writer_for(verbatim, store, CodecId.RAW, path)  # type: ignore[arg-type]
        assert isinstance(chosen, kind)
        chosen.close()
    quantized = writer_for(verbatim, store, get_codec("int8-sym").codec_id, "staged")
    assert isinstance(quantized, RingWriter)  # int8 frames are decoded: not verbatim
    quantized.close()


# -- the connector's config keys for the staged paths --------------------------------------------

def test_staged_path_config_keys(tmp_path: Path) -> None:
    from connectors.vllm.config import ConnectorConfig

    base = {"store": {"host_bytes": 1 << 20}}
    default = ConnectorConfig.from_extra(base)
    assert (default.restore_path, default.save_path, default.store.host_pinned) == (
        "auto", "auto", False)
    config = ConnectorConfig.from_extra({"store": {"host_bytes": 1 << 20, "host_pinned": True},
                                         "restore_path": "staged", "save_path": "staged"})
    assert (config.restore_path, config.save_path, config.store.host_pinned) == (
        "staged", "staged", True)
    assert ConnectorConfig.from_extra({**base, "restore_path": "device_decode"}).restore_path \
        == "device_decode"
    # Every save_path works with compression, a MAC key and durability (one save pipeline).
    key_file = tmp_path / "mac"
    key_file.write_text("ab" * 32)
    combined = ConnectorConfig.from_extra({
        "store": {"host_bytes": 1 << 20, "remote": {"daemons": {"a": "127.0.0.1:1"}}},
        "save_path": "staged", "compression": "zstd", "mac_key_file": str(key_file),
        "durability": {"replicas": 1}})
    assert combined.save_path == "staged" and combined.durability is not None
    for bad in ({**base, "restore_path": "fast"}, {**base, "save_path": "device"},
                {"store": {"host_bytes": 1 << 20, "host_pinned": "yes"}}):
        with pytest.raises(ConfigError):
            ConnectorConfig.from_extra(bad)


@pytest.mark.parametrize("layout", ["transposed", "flash"])
def test_device_decode_path_restores_what_frames_hold(store: TieredStore, layout: str) -> None:
    """`restore_path: "device_decode"`: chunks staged on the cache's device (here the host, the
    same code a GPU runs) and decoded there in one batch per layer."""
    caches, fp = _caches(layout, torch.bfloat16, "int8-sym")
    gen = torch.Generator().manual_seed(13)
    hashes = [bytes([i + 1]) * 32 for i in range(6)]
    keys = [BlockKey.of(fp, Namespace("t"), h) for h in hashes]
    frames = {key: _frame(caches, key, "int8-sym", gen) for key in keys}
    for key in keys:
        assert store.put(key, frames[key])
    counters, outbox = Counts(), WorkerOutbox()
    loader = Loader(WorkerContext(store, caches, fp, get_codec("int8-sym").codec_id, outbox,
                                  counters), deadline_s=10.0, path="device_decode")
    targets = (2, 4, 6, 8, 10, 12)
    try:
        assert _load(loader, targets, hashes)
    finally:
        loader.shutdown()
    assert counters.snapshot()[Count.LOADED_BLOCKS] == 6
    for key, block_id in zip(keys, targets, strict=True):
        for layer in range(LAYERS):
            assert torch.equal(_restored(caches, layer, block_id),
                               _expected(caches, frames[key], layer))
