"""The loader on its own, against a real store (host tier) and synthetic paged tensors of each
CPU layout: layouts that hold frames verbatim are decoded straight into the cache, the others
through a staging tensor and a scatter; layer stages read [0, k) first; a corrupt or missing
block fails alone and writes nothing after the job is cancelled."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from connectors.vllm.caches import PagedCaches
from connectors.vllm.layouts import LayoutSpec
from connectors.vllm.loader import Loader, layer_stages
from connectors.vllm.metadata import BlockRun, LoadSpec
from connectors.vllm.outbox import WorkerOutbox
from connectors.vllm.stats import Count, Counts
from connectors.vllm.worker_context import WorkerContext
from kvstore.block import decode_layer, encode_block
from kvstore.frame import BlockRead, CodecId, LayerRange
from kvstore.keys import BlockKey, ModelFingerprint, Namespace
from kvstore.store import TieredStore
from kvstore.tiers.memory.host import HostTier

LAYERS, HEADS, HEAD_SIZE, BLOCK = 4, 2, 16, 8
NUM_BLOCKS = 24


@pytest.fixture
def store() -> Iterator[TieredStore]:
    tiered = TieredStore([HostTier(32 << 20)])
    try:
        yield tiered
    finally:
        tiered.close()


def _setup(layout_id: str, family: str, codec: str, dtype: torch.dtype
           ) -> tuple[LayoutSpec, ModelFingerprint, PagedCaches]:
    spec = LayoutSpec(layout_id, family, HEADS, HEAD_SIZE, BLOCK)  # type: ignore[arg-type]
    fp = ModelFingerprint("m", "w", str(dtype).removeprefix("torch."), LAYERS, HEADS,
                          HEAD_SIZE, BLOCK, layout_id, codec)
    caches = PagedCaches(spec, LAYERS)
    caches.register({f"model.layers.{i}.self_attn.attn":
                     torch.zeros((NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD_SIZE), dtype=dtype)
                     for i in range(LAYERS)})
    return spec, fp, caches


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("codec", ["raw", "int8"])
@pytest.mark.parametrize("first_layers", [0, 1, 3])
@pytest.mark.parametrize("layout", [("cpu-amx/raw", "cpu-raw"), ("cpu/tnhd", "cpu-kt")],
                         ids=["verbatim", "transposed"])
def test_loader_restores_what_frames_hold(store: TieredStore, layout: tuple[str, str],
                                          first_layers: int, codec: str,
                                          dtype: torch.dtype) -> None:
    spec, fp, caches = _setup(*layout, codec, dtype)
    assert (caches.host_blocks[0] is not None) == (layout[1] == "cpu-raw")
    gen = torch.Generator().manual_seed(3)
    hashes = [bytes([i + 1]) * 32 for i in range(16)]  # enough for concurrent store reads
    keys = [BlockKey.of(fp, Namespace("t"), h) for h in hashes]
    frames = {}
    for key in keys:
        layers = [torch.randn(spec.block_shape, generator=gen).to(dtype) for _ in range(LAYERS)]
        frames[key] = encode_block(layers, codec=codec, key=key, token_count=BLOCK,
                                   layout_id=spec.layout_id, compression="none")
    bad = bytearray(frames[keys[1]])
    bad[-7] ^= 0xFF  # in the last layer's segment
    for i, key in enumerate(keys):
        if i != 4:  # block 4 is missing
            assert store.put(key, bytes(bad) if i == 1 else frames[key])
    # Block 1 is corrupt in the store (which verifies: a miss); block 2 turns corrupt after
    # the store's check, in its last layer (so only the last stage finds it): the loader's own
    # verification catches it.
    real_get_many = store.get_many

    def get_many(*args: Any, **kwargs: Any) -> list[BlockRead | None]:
        reads: list[BlockRead | None] = real_get_many(*args, **kwargs)
        for i, read in enumerate(reads):
            if read is not None and read.header.key_digest == keys[2].digest \
                    and read.layers.stop == LAYERS:
                payload = bytearray(read.payload)
                payload[-7] ^= 0xFF
                reads[i] = BlockRead(read.header, read.layers, payload)
        return reads

    store.get_many = get_many  # type: ignore[method-assign]
    counters, outbox = Counts(), WorkerOutbox()
    codec_id = CodecId.INT8 if codec == "int8" else CodecId.RAW
    loader = Loader(WorkerContext(store, caches, fp, codec_id, outbox, counters),
                    deadline_s=10.0, first_layers=first_layers)
    targets = (3, 7, 8, 12, 13, 20, 1, 2, 4, 5, 6, 9, 10, 22, 23, 15)
    try:
        loader.start([LoadSpec(BlockRun("r", "t", 0, targets, tuple(hashes)))])
        for layer in range(LAYERS):
            loader.wait_for_layer(layer)
        assert not loader.finish_step()
    finally:
        loader.shutdown()
    snapshot = counters.snapshot()
    assert snapshot[Count.LOAD_MISSING] == 2 and snapshot[Count.LOAD_CORRUPT] == 1
    assert snapshot[Count.LOADED_BLOCKS] == 13
    assert outbox.take_load_errors() == {targets[1], targets[2], targets[4]}
    report = outbox.take_report()
    assert report is not None and [(r.first, r.count, r.restored) for r in report.loads] == [
        (0, 16, 1)]
    for i, (key, block_id) in enumerate(zip(keys, targets, strict=True)):
        if i in (1, 2, 4):
            continue
        read = BlockRead.from_frame(frames[key])
        for layer in range(LAYERS):
            expected = decode_layer(read, layer, out=torch.empty(spec.block_shape, dtype=dtype))
            got = caches.bound[layer].gather(caches.tensors[layer], torch.tensor([block_id]))[0]
            assert torch.equal(got, expected), (i, layer)
    untouched = set(range(NUM_BLOCKS)) - set(targets)
    for layer in range(LAYERS):
        assert not caches.tensors[layer][sorted(untouched)].any()


def test_a_cancelled_load_writes_nothing_more(store: TieredStore) -> None:
    """Past its deadline the job is cancelled: the blocks fail late, and no layer is written
    after the forward pass gave up on it."""
    spec, fp, caches = _setup("cpu-amx/raw", "cpu-raw", "raw", torch.bfloat16)
    key = BlockKey.of(fp, Namespace("t"), b"\x09" * 32)
    store.put(key, encode_block([torch.ones(spec.block_shape, dtype=torch.bfloat16)] * LAYERS,
                                codec="raw", key=key, token_count=BLOCK,
                                layout_id=spec.layout_id, compression="none"))
    real_get_many = store.get_many
    release = __import__("threading").Event()

    def slow_get_many(*args: object, **kwargs: object) -> object:
        release.wait(5)
        return real_get_many(*args, **kwargs)  # type: ignore[arg-type]

    store.get_many = slow_get_many  # type: ignore[method-assign,assignment]
    counters, outbox = Counts(), WorkerOutbox()
    loader = Loader(WorkerContext(store, caches, fp, CodecId.RAW, outbox, counters),
                    deadline_s=0.2)
    try:
        loader.start([LoadSpec(BlockRun("r", "t", 0, (5,), (b"\x09" * 32,)))])
        loader.wait_for_layer(0)  # times out at the deadline and cancels
        release.set()
        assert not loader.finish_step()
    finally:
        loader.shutdown()
        del store.get_many
    assert counters.snapshot()[Count.LOAD_LATE] == 1
    assert not any(t[5].any() for t in caches.tensors)


def test_layer_stages() -> None:
    assert layer_stages(8, 0) == (LayerRange(0, 8),)
    assert layer_stages(8, 8) == (LayerRange(0, 8),)
    assert layer_stages(8, 2) == (LayerRange(0, 2), LayerRange(2, 8))
