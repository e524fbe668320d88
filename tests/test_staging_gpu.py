"""The staging pipelines on a GPU (gpu-marked: skipped without CUDA; run by
benchmarks/gpu_checks.sh): CUDA copy lanes order their work by events, a page-locked host
tier lends pinned pages, and staged restores (hashed, trusted, one DMA per lent page run) and
saves (quantized on the device) move blocks of a flash-layout device cache exactly as the host
pipeline does. Without CUDA, a page-locked host tier is refused with a clear error."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pytest
import torch

from connectors.vllm.caches import PagedCaches
from connectors.vllm.layouts import cuda_layout
from connectors.vllm.staging import RestorePipeline, StagingConfig, writer_for
from connectors.vllm.staging.jobs import BatchJob, StagedBlock
from connectors.vllm.staging.ring_restore import pinned
from connectors.vllm.staging.save import (
    FrameSettings,
    RingFramer,
    SaveBatch,
    SavePipeline,
    WriteBehind,
)
from connectors.vllm.staging.streams import is_cuda_event, lane_for
from connectors.vllm.stats import Count
from kvstore.block import encode_block
from kvstore.codecs import get_codec
from kvstore.errors import ConfigError
from kvstore.frame import BlockRead, FrameHeader, LayerRange
from kvstore.keys import BlockKey, ModelFingerprint, Namespace
from kvstore.store import StoreConfig, TieredStore
from kvstore.tiers.memory.host import HostTier

LAYERS, HEADS, HEAD_SIZE, BLOCK, NUM_BLOCKS = 4, 2, 64, 16, 24
PAGE = 4096


@pytest.fixture
def pinned_store() -> Iterator[TieredStore]:
    tier = HostTier(64 << 20, page_bytes=PAGE, arena_bytes=4 << 20, pinned=True)
    with TieredStore([tier], config=StoreConfig(promote=False)) as store:
        yield store


def _device_caches() -> tuple[PagedCaches, ModelFingerprint]:
    spec = cuda_layout(num_kv_heads=HEADS, head_size=HEAD_SIZE, block_size=BLOCK)
    caches = PagedCaches(spec, LAYERS)
    gen = torch.Generator(device="cuda").manual_seed(1)
    caches.bind([torch.randn((2, NUM_BLOCKS, BLOCK, HEADS, HEAD_SIZE), generator=gen,
                             device="cuda", dtype=torch.bfloat16) for _ in range(LAYERS)])
    fp = ModelFingerprint("m", "w", "bfloat16", LAYERS, HEADS, HEAD_SIZE, BLOCK, "cuda/tnhd",
                          "raw")
    return caches, fp


def _accept(_: FrameHeader) -> None:
    return None


def _nothing_below(_job: object, _layers: LayerRange, blocks: Sequence[object]
                   ) -> list[BlockRead | None]:
    return [None] * len(blocks)  # (the host tier holds every block)


def _job(keys: list[BlockKey], targets: list[int]) -> BatchJob:
    import time

    return BatchJob([StagedBlock(t, k) for k, t in zip(keys, targets, strict=True)],
                    time.monotonic() + 30, LAYERS)


def test_a_pinned_host_tier_needs_cuda() -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    with pytest.raises(ConfigError, match="CUDA"):
        HostTier(1 << 20, pinned=True)


@pytest.mark.gpu
def test_cuda_lanes_order_work_by_events() -> None:
    device = torch.device("cuda")
    first, second = lane_for(device), lane_for(device)
    source = torch.arange(1 << 22, device=device, dtype=torch.float32)
    target = torch.empty_like(source)
    with first.activate():
        torch.cuda._sleep(10_000_000)  # type: ignore[no-untyped-call]  # keep the first lane busy: the second must wait
        target.copy_(source * 2)
        done = first.record()
    assert is_cuda_event(done)
    with second.activate():
        second.wait(done)
        result = target + 1
        finished = second.record()
    finished.synchronize()
    assert torch.equal(result, source * 2 + 1)


@pytest.mark.gpu
def test_pinned_host_tier_lends_page_locked_pages(pinned_store: TieredStore) -> None:
    caches, fp = _device_caches()
    key = BlockKey.of(fp, Namespace("t"), b"\x01" * 32)
    layers = [caches.bound[i].gather(caches.tensors[i], torch.tensor([0], device="cuda"))[0]
              for i in range(LAYERS)]
    assert pinned_store.put(key, encode_block(layers, codec="raw", key=key, token_count=BLOCK,
                                              layout_id="cuda/tnhd", compression="none"))
    lent = pinned_store.borrow(key)
    assert lent is not None
    try:
        assert pinned(lent)
    finally:
        lent.release()


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["hashed", "trusted", "direct", "int8"])
def test_staged_restore_on_the_device(pinned_store: TieredStore, variant: str) -> None:
    caches, fp = _device_caches()
    codec = "int8-kivi" if variant == "int8" else "raw"
    codec_id = get_codec(codec).codec_id
    sources, targets = list(range(0, 10)), list(range(12, 22))
    keys = [BlockKey.of(fp, Namespace("t"), bytes([i + 1]) * 32) for i in sources]
    originals = [caches.bound[i].gather(caches.tensors[i], torch.tensor(sources, device="cuda"))
                 for i in range(LAYERS)]
    frames = {}
    for j, key in enumerate(keys):
        frames[key] = encode_block([layer[j] for layer in originals], codec=codec, key=key,
                                   token_count=BLOCK, layout_id="cuda/tnhd",
                                   compression="none")
        assert pinned_store.put(key, frames[key])
    host = pinned_store.tiers[0]
    assert isinstance(host, HostTier)
    bad = BlockRead.from_frame(frames[keys[3]]).header.segments[2].offset + 5
    if variant != "trusted":  # a bit flipped in RAM: caught unless the pages are trusted
        entry = host._index[keys[3].digest]
        host._page_views[entry.pages[bad // PAGE]][bad % PAGE] ^= 0x20
    config = StagingConfig(slots=2, slot_bytes=3 * LAYERS * get_codec(codec).encoded_size(
        caches.block_shape, caches.dtype), workers=3, trust_host_pages=variant == "trusted",
        direct_from_pinned=variant == "direct")
    writer = writer_for(caches, pinned_store, codec_id, "staged", config)
    pipeline = RestorePipeline(pinned_store, writer, read=_nothing_below, refusal=_accept)
    job = _job(keys, targets)
    try:
        pipeline.load(job, (LayerRange(0, 1), LayerRange(1, LAYERS)))
    finally:
        pipeline.close()
    assert all(event is not None for event in job.device_done)
    for event in job.device_done:
        assert event is not None
        event.synchronize()
    if variant == "trusted":
        assert not job.failed
    else:
        assert job.failed == {targets[3]: Count.LOAD_CORRUPT}
    restored = [caches.bound[i].gather(caches.tensors[i], torch.tensor(targets, device="cuda"))
                for i in range(LAYERS)]
    for layer in range(LAYERS):
        for j in range(len(keys)):
            if j == 3 and variant != "trusted":
                continue
            if variant == "int8":
                error = (restored[layer][j].float() - originals[layer][j].float()).abs().max()
                assert error.item() <= 2 * originals[layer][j].float().abs().max().item() / 255
            else:
                assert torch.equal(restored[layer][j], originals[layer][j]), (layer, j)


@pytest.mark.gpu
@pytest.mark.parametrize("codec", ["raw", "int8-kivi"])
def test_staged_save_on_the_device(pinned_store: TieredStore, codec: str) -> None:
    caches, fp = _device_caches()
    ids = torch.tensor([5, 1, 7, 2, 9], device="cuda")
    keys = [BlockKey.of(fp, Namespace("t"), bytes([i + 1]) * 32) for i in range(len(ids))]
    layers = [caches.bound[i].gather(caches.tensors[i], ids) for i in range(LAYERS)]
    ready = [torch.cuda.current_stream().record_event()]
    reports: dict[int, bool] = {}
    settings = FrameSettings(get_codec(codec).codec_id, "none", None)
    framer = RingFramer(caches, settings, StagingConfig(slots=2, slot_bytes=1 << 18))
    pipeline = SavePipeline(framer, WriteBehind(pinned_store))
    try:
        pipeline.save(SaveBatch(keys, layers, range(len(keys)), ready),
                      lambda j, saved: reports.__setitem__(j, saved.stored))
    finally:
        pipeline.close()
    assert reports == dict.fromkeys(range(len(ids)), True)
    for j, key in enumerate(keys):
        read = pinned_store.get(key)
        assert read is not None
        if codec == "raw":
            assert read.to_frame() == encode_block(
                [layer[j].cpu() for layer in layers], codec="raw", key=key, token_count=BLOCK,
                layout_id="cuda/tnhd", compression="none")
