"""The staged restore's writer for host caches that hold a raw frame's layers verbatim (vLLM's
CPU backend on AMX, `cpu-amx/raw`): no staging slot at all. Each block is checked where it
lies (pages lent by the host tier hashed in place, once, unless `trust_host_pages`; a lower
tier's reads were verified by that tier) and then copied once, straight from those pages into
its paged block by the pool's threads, under the job's lock (nothing is written after a
cancel, nor before a block's check)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import numpy.typing as npt

from connectors.vllm.caches import PagedCaches
from connectors.vllm.staging.config import StagingConfig
from connectors.vllm.staging.jobs import Located, RestoreJob, all_results
from connectors.vllm.staging.restore import WriteRun
from connectors.vllm.staging.ring import split
from connectors.vllm.staging.timing import StageTimes
from connectors.vllm.stats import Count
from kvstore import frame
from kvstore.codecs import get_codec
from kvstore.errors import CorruptBlock
from kvstore.frame import CodecId, LayerRange
from kvstore.store import TieredStore

__all__ = ["InPlaceWriter"]

_Bytes = npt.NDArray[np.uint8]


class InPlaceWriter:
    borrows = True

    def __init__(self, caches: PagedCaches, store: TieredStore, codec: CodecId,
                 config: StagingConfig) -> None:
        self._caches = caches
        self._store = store
        self._config = config
        self._segment = get_codec(codec).encoded_size(caches.block_shape, caches.dtype)
        self._pool = ThreadPoolExecutor(config.workers, thread_name_prefix="kvkeep-stage")
        self.times = StageTimes()

    def unit_blocks(self, layers: LayerRange) -> int:
        # No slot to fill: a unit is what a slot would hold, so memory held by lent pages
        # and reads stays as bounded as the ring's.
        return self._config.slot_bytes // (len(layers) * self._segment)

    def start(self, job: RestoreJob) -> WriteRun:
        return _InPlaceRun(self, job)

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def write(self, job: RestoreJob, layers: LayerRange, entries: list[Located],
              last: bool) -> bool:
        """Host caches holding frames verbatim: check each block where it lies (lent pages
        are hashed in place, once, unless trusted; a lower tier's reads were verified by it),
        then copy it straight into its paged block on the pool, under the job's lock: one
        copy per block, none written after a cancel or before its check. False once the job
        is cancelled or late."""
        try:
            live = [entry for entry in entries if entry.block.block_id not in job.failed]
            parts = split(len(live), self._config.workers)
            started = time.perf_counter()
            checks = [self._pool.submit(self._check, live, layers, rows)
                      for rows in parts]
            bad = dict(failure for failures in all_results(checks) for failure in failures)
            self.times.add("verify", time.perf_counter() - started)
            for row, reason in bad.items():
                job.fail(live[row].block.block_id, reason)
                self._store.delete([live[row].block.key])
            good = [entry for row, entry in enumerate(live)
                    if row not in bad and entry.block.block_id not in job.failed]
            with job.lock:
                if not job.still_on_time():
                    return False
                started = time.perf_counter()
                copies = [self._pool.submit(self._copy, good, layers, rows)
                          for rows in split(len(good), self._config.workers)]
                all_results(copies)
                self.times.add("host_copy", time.perf_counter() - started)
        finally:
            for entry in entries:
                entry.release()
        if last:
            for layer in range(layers.start, layers.stop):
                job.layer_done[layer].set()
        return True

    def _check(self, entries: Sequence[Located], layers: LayerRange, rows: range
               ) -> list[tuple[int, Count]]:
        failed = []
        for row in rows:
            entry = entries[row]
            try:
                if entry.borrowed is not None:
                    if not self._config.trust_host_pages:
                        frame.verify_pieces(entry.header, layers, entry.borrowed.pieces)
                elif entry.read is not None:
                    entry.read.verify()  # a no-op for the store's reads: verified by their tier
                    for layer in range(layers.start, layers.stop):
                        if len(entry.read.segment(layer)) != self._segment:
                            raise CorruptBlock(f"segment {layer} is not {self._segment} bytes")
            except CorruptBlock:
                failed.append((row, Count.LOAD_CORRUPT))
        return failed

    def _copy(self, entries: Sequence[Located], layers: LayerRange, rows: range
              ) -> list[tuple[int, Count]]:
        caches = self._caches.host_blocks
        for row in rows:
            entry = entries[row]
            targets = [_flat_bytes(caches[layer], entry.block.block_id)
                       for layer in range(layers.start, layers.stop)]
            if entry.borrowed is not None:
                _copy_across(entry.borrowed.pieces, targets)
            elif entry.read is not None:
                for target, layer in zip(targets, range(layers.start, layers.stop), strict=True):
                    np.copyto(target, np.frombuffer(entry.read.segment(layer), np.uint8))
        return []


def _flat_bytes(blocks: npt.NDArray[np.generic] | None, block_id: int) -> _Bytes:
    """Paged block `block_id` of a host cache layer as its bytes (a view, no copy)."""
    assert blocks is not None  # (only called where every layer has them)
    return np.ravel(blocks[block_id]).view(np.uint8)


def _copy_across(pieces: Sequence[memoryview], targets: Sequence[_Bytes]) -> None:
    """Copy the bytes of `pieces` (back to back) into `targets` (back to back): page runs
    and segments need not line up. The sizes were checked to match."""
    sources = [np.frombuffer(piece, np.uint8) for piece in pieces]
    index, offset = 0, 0
    for target in targets:
        filled = 0
        while filled < len(target):
            source = sources[index]
            take = min(len(target) - filled, len(source) - offset)
            np.copyto(target[filled: filled + take], source[offset: offset + take])
            filled, offset = filled + take, offset + take
            if offset == len(source):
                index, offset = index + 1, 0



class _InPlaceRun:
    """Nothing is kept in flight between units: each is written before the next."""

    def __init__(self, writer: InPlaceWriter, job: RestoreJob) -> None:
        self._writer = writer
        self._job = job

    def write(self, layers: LayerRange, entries: list[Located], last: bool) -> bool:
        return self._writer.write(self._job, layers, entries, last)

    def finish(self) -> bool:
        return True

    def abandon(self) -> None:
        pass
