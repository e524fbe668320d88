"""The restore pipeline's default writer (`restore_path` "auto" and "device_decode"): each
layer of a unit decoded and scattered, layer by layer, so the forward pass computes layer i
while later layers are still being written.

- Host caches whose blocks hold frames verbatim (vLLM's CPU backend): each block's segment is
  decoded straight into its paged block (the read's bytes are copied once, by the decoder).
- Otherwise: up to `_LOAD_CHUNK_BLOCKS` blocks of a layer decoded into a staging tensor,
  on the host ("auto": the path measured on an H200, int8 restores at 0.19-0.24x a pageable
  copy up) or on the cache's device ("device_decode": a chunk's segments go up in one copy and
  are decoded there; tested on CPU and under the gpu marker, not yet measured, so not the
  default: `python -m benchmarks.gpu` compares both), then copied over and scattered.

A unit is a whole layer range of the job (the pipeline fetches the next range meanwhile);
every block is read from the store (decompressed and verified by its tier) and verified
again by the decoder against its key.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from connectors.vllm.caches import PagedCaches, recorded_event
from connectors.vllm.staging.jobs import Located, RestoreJob
from connectors.vllm.staging.restore import WriteRun
from connectors.vllm.staging.timing import StageTimes
from connectors.vllm.stats import Count
from kvstore.block import decode_layer, decode_layer_batch
from kvstore.errors import CodecError, CorruptBlock
from kvstore.frame import BlockRead, LayerRange
from kvstore.store import TieredStore

__all__ = ["DecodeWriter"]

# Blocks decoded and scattered per step of a load: bounds the staging tensor (a GPU's memory
# beside vLLM's cache) while keeping each copy up large (256 blocks of 128 KiB = 32 MiB).
_LOAD_CHUNK_BLOCKS = 256

# A unit is a whole layer range: the pipeline reads it while the previous one is written.
_WHOLE_RANGE = 1 << 30


class DecodeWriter:
    borrows = False

    def __init__(self, caches: PagedCaches, store: TieredStore, *, on_device: bool) -> None:
        self._caches = caches
        self._store = store
        self._on_device = on_device
        self.times = StageTimes()

    def unit_blocks(self, layers: LayerRange) -> int:
        return _WHOLE_RANGE

    def start(self, job: RestoreJob) -> WriteRun:
        return _DecodeRun(self, job)

    def close(self) -> None:
        pass

    def on_cuda(self, layer: int) -> bool:
        return bool(self._caches.tensors[layer].is_cuda)

    def staging(self, blocks: int) -> torch.Tensor:
        device = self._caches.tensors[0].device if self._on_device else torch.device("cpu")
        return torch.empty((min(blocks, _LOAD_CHUNK_BLOCKS), *self._caches.block_shape),
                           dtype=self._caches.torch_dtype, device=device)

    def write_layer(self, job: RestoreJob, layer: int, entries: Sequence[Located],
                    staging: _Staging) -> bool:
        """Decode and scatter one layer of `entries`; False once the job is cancelled or
        late (then nothing more may be written)."""
        direct = self._caches.host_blocks[layer]
        if direct is not None:
            return self._decode_into_cache(job, layer, entries, direct)
        for start in range(0, len(entries), _LOAD_CHUNK_BLOCKS):
            if not self._scatter_chunk(job, layer, entries[start:start + _LOAD_CHUNK_BLOCKS],
                                       staging.rows()):
                return False
        return True

    def _decode_into_cache(self, job: RestoreJob, layer: int, entries: Sequence[Located],
                           blocks: np.ndarray[Any, Any]) -> bool:
        """Decode one layer of each block straight into its paged block. Each block is
        decoded under the job's lock, so none is written after a cancel; the segment is
        verified before a byte is written."""
        for entry in entries:
            block = entry.block
            with job.lock:
                if not job.still_on_time():
                    return False
                try:
                    decode_layer(_read(entry), layer, out=blocks[block.block_id],
                                 key=block.key)
                    continue
                except (CorruptBlock, CodecError):
                    # (an int8 segment refused for its scales may be half written: the
                    # block fails, and vLLM recomputes it over whatever is there)
                    job.fail(block.block_id, Count.LOAD_CORRUPT)
            self._store.delete([block.key])
        return True

    def _scatter_chunk(self, job: RestoreJob, layer: int, chunk: Sequence[Located],
                       staging: torch.Tensor) -> bool:
        """Decode one layer of `chunk`'s blocks and scatter the good ones into the cache."""
        errors = decode_layer_batch([_read(entry) for entry in chunk], layer, staging,
                                    keys=[entry.block.key for entry in chunk])
        rows: list[int] = []  # rows of `staging` that hold this layer, verified
        targets: list[int] = []  # and the paged blocks they go to
        for row, (entry, error) in enumerate(zip(chunk, errors, strict=True)):
            if error is not None:
                job.fail(entry.block.block_id, Count.LOAD_CORRUPT)
                self._store.delete([entry.block.key])
                continue
            rows.append(row)
            targets.append(entry.block.block_id)
        with job.lock:
            if not job.still_on_time():
                return False
            if rows:
                cache = self._caches.tensors[layer]
                data = staging.index_select(0, torch.tensor(rows, device=staging.device))
                self._caches.bound[layer].scatter(
                    cache, torch.tensor(targets, device=cache.device), data.to(cache.device))
        return True


class _Staging:
    """The tensor a run decodes into before scattering, allocated on first use (layouts
    decoded in place need none)."""

    def __init__(self, writer: DecodeWriter, blocks: int) -> None:
        self._writer = writer
        self._blocks = blocks
        self._tensor: torch.Tensor | None = None

    def rows(self) -> torch.Tensor:
        if self._tensor is None:
            self._tensor = self._writer.staging(self._blocks)
        return self._tensor


class _DecodeRun:
    def __init__(self, writer: DecodeWriter, job: RestoreJob) -> None:
        self._writer = writer
        self._job = job
        self._staging = _Staging(writer, len(job.blocks))

    def write(self, layers: LayerRange, entries: list[Located], last: bool) -> bool:
        job, writer = self._job, self._writer
        started = time.perf_counter()
        try:
            for layer in range(layers.start, layers.stop):
                wanted = [entry for entry in entries if entry.block.block_id not in job.failed]
                if not writer.write_layer(job, layer, wanted, self._staging):
                    return False
                if last:
                    with job.lock:
                        if not job.still_on_time():
                            return False
                        if wanted and writer.on_cuda(layer):
                            job.device_done[layer] = recorded_event()
                    job.layer_done[layer].set()
        finally:
            writer.times.add("decode", time.perf_counter() - started)
        return True

    def finish(self) -> bool:
        return True

    def abandon(self) -> None:
        pass


def _read(entry: Located) -> BlockRead:
    assert entry.read is not None  # (this writer does not borrow: every block was read)
    return entry.read
