"""Disk faults on a daemon's data dir, and the probe that says whether corrupt KV was served.

Corruption flips bytes in place in a daemon's newest block files (`blocks/<shard>/*.kvb`, one
frame per file): 64 bytes in the middle of the payload, or for every fourth block one byte of
the header. The original frame and the block's full key are kept, so that at the end of the run
`probe_corrupted` can ask every daemon for every corrupted block through the project's own
client and check what comes back, as the connector would: a miss, or a frame that fails
verification (the client drops it), is safe; a frame that passes verification but differs from
the original is corrupt KV served. The full key comes from the daemon's key catalog
(`keys.log`), read at corruption time from a copy, so the live daemon's file is never touched;
only blocks the catalog names are corrupted.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from deploy.local.disks import FILLER_NAME, fill
from kvstore.errors import CorruptBlock, KVKeepError

if TYPE_CHECKING:
    from kvstore.frame import BlockRead
    from kvstore.keys import BlockKey

__all__ = ["CorruptedBlock", "ProbeResult", "corrupt_blocks", "probe_corrupted", "fill_disk",
           "free_disk"]

_FLIP = 64
# How far a recomputed block's values may lie from the first computation's, relative to the
# largest magnitude in the block: bf16 rounding of a differently blocked matmul moves values by
# a few units in the last place, a corrupted byte by anything at all.
_RECOMPUTE_TOLERANCE = 0.05


@dataclass(frozen=True, slots=True)
class CorruptedBlock:
    daemon: str
    key: BlockKey
    original: bytes
    where: str
    """"payload" or "header"."""


@dataclass(frozen=True, slots=True)
class ProbeResult:
    probes: int = 0
    misses: int = 0
    intact: int = 0
    """A verified frame equal to the original (another replica's copy, or a re-put)."""
    rejected: int = 0
    """The daemon sent a frame that fails verification: the client drops it (safe)."""
    served_corrupt: int = 0
    """A frame that passes verification and is neither the original nor a recomputation of
    it: never acceptable."""
    replaced: int = 0
    """A verified frame that is not the original but a recomputation of the same block (the
    corrupted copy was dropped, vLLM recomputed the block and saved it again): same codec,
    dtype and shape, every value within `_RECOMPUTE_TOLERANCE` of the original's. On CPU a
    block recomputed in another batch or prefill chunk differs from the first in low bits."""
    replaced_max_abs_diff: float = 0.0
    errors: int = 0


def fill_disk(data_dir: Path) -> int:
    return fill(data_dir)


def free_disk(data_dir: Path) -> None:
    (data_dir / FILLER_NAME).unlink(missing_ok=True)


def corrupt_blocks(daemon: str, data_dir: Path, count: int, rng: random.Random
                   ) -> list[CorruptedBlock]:
    """Flip bytes in up to `count` of the newest block files; returns what was done."""
    from kvstore.frame import BlockRead

    keys = _catalog_keys([data_dir])
    files = []
    for path in data_dir.rglob("*.kvb"):
        try:
            files.append((path.stat().st_mtime, path))
        except FileNotFoundError:
            continue  # evicted meanwhile
    files.sort(reverse=True)
    done: list[CorruptedBlock] = []
    for _mtime, path in files:
        if len(done) == count:
            break
        key = keys.get(bytes.fromhex(path.stem))
        if key is None:
            continue  # written before its catalog entry, or being deleted
        try:
            original = path.read_bytes()
            read = BlockRead.from_frame(original)
        except (OSError, CorruptBlock, ValueError):
            continue  # being replaced, or already damaged
        header_end = len(original) - len(read.payload)
        where = "header" if len(done) % 4 == 3 else "payload"
        if where == "payload" and len(read.payload) > _FLIP:
            offset = header_end + rng.randrange(len(read.payload) - _FLIP)
            patch = bytes(b ^ 0xFF for b in original[offset:offset + _FLIP])
        else:
            where = "header"
            offset = rng.randrange(max(1, header_end))
            patch = bytes([original[offset] ^ 0x5A])
        try:
            fd = os.open(path, os.O_WRONLY)
        except FileNotFoundError:
            continue
        try:
            os.pwrite(fd, patch, offset)
        finally:
            os.close(fd)
        done.append(CorruptedBlock(daemon, key, original, where))
    return done


def probe_corrupted(blocks: list[CorruptedBlock], daemons: dict[str, str],
                    token: str | None) -> ProbeResult:
    """Read every corrupted block from every live daemon (node id -> address)."""
    from kvstore.frame import BlockRead
    from kvstore.net.daemon_client import DaemonClient
    from kvstore.net.scope import Scope

    counts: dict[str, Any] = {"probes": 0, "misses": 0, "intact": 0, "rejected": 0,
                              "served_corrupt": 0, "replaced": 0, "replaced_max_abs_diff": 0.0,
                              "errors": 0}
    for block in blocks:
        key = block.key
        original = BlockRead.from_frame(block.original)
        for node_id, address in daemons.items():
            client = DaemonClient(node_id, address, token=token)
            counts["probes"] += 1
            try:
                read = client.get(Scope(key.fingerprint, key.namespace), key.block_hash,
                                  timeout=5.0)
            except KVKeepError:
                counts["errors"] += 1
                continue
            finally:
                client.close()
            if read is None:
                counts["misses"] += 1
                continue
            try:
                BlockRead(read.header, read.layers, read.payload).verified_for(key.digest)
            except CorruptBlock:
                counts["rejected"] += 1
                continue
            if bytes(read.payload) == bytes(original.payload):
                counts["intact"] += 1
                continue
            diff = _recomputed_diff(original, read)
            if diff is None:
                counts["served_corrupt"] += 1
            else:
                counts["replaced"] += 1
                counts["replaced_max_abs_diff"] = max(counts["replaced_max_abs_diff"], diff)
    return ProbeResult(**counts)


def _recomputed_diff(original: BlockRead, read: BlockRead) -> float | None:
    """The largest value difference when `read` is a recomputation of `original` (same raw
    16-bit frame shape, values within tolerance); None when it cannot be one."""
    import numpy as np
    import torch

    from kvstore.frame import CodecId, DType

    a, b = original.header, read.header
    if (a.codec, a.dtype, a.layout_id, a.token_count) != (b.codec, b.dtype, b.layout_id,
                                                          b.token_count) \
            or a.codec != CodecId.RAW or a.dtype not in (DType.FLOAT16, DType.BFLOAT16) \
            or len(original.payload) != len(read.payload) or len(read.payload) % 2:
        return None
    torch_dtype = torch.bfloat16 if a.dtype == DType.BFLOAT16 else torch.float16

    def values(payload: bytes | bytearray | memoryview) -> torch.Tensor:
        raw = np.frombuffer(bytes(payload), dtype=np.int16).copy()
        return torch.from_numpy(raw).view(torch_dtype).float()

    first, second = values(original.payload), values(read.payload)
    if not (torch.isfinite(first).all() and torch.isfinite(second).all()):
        return None
    scale = float(first.abs().max()) or 1.0
    diff = float((first - second).abs().max())
    return diff if diff <= _RECOMPUTE_TOLERANCE * scale else None


def _catalog_keys(data_dirs: Iterable[Path]) -> dict[bytes, BlockKey]:
    from kvstore.daemon.catalog import KeyCatalog

    keys: dict[bytes, BlockKey] = {}
    for data_dir in data_dirs:
        log = data_dir / "keys.log"
        if not log.exists():
            continue
        with tempfile.TemporaryDirectory(prefix="kvkeep-probe-") as tmp:
            copy = Path(tmp) / "keys.log"
            shutil.copyfile(log, copy)
            catalog = KeyCatalog(copy)
            try:
                for key in catalog.keys():  # noqa: SIM118 (a method, not a dict)
                    keys[key.digest] = key
            finally:
                catalog.close()
    return keys
