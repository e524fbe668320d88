"""The process tests/test_nvme_crash.py kills: puts blocks and manifests to an nvme tier forever.

    python -m tests.nvme_crash_writer DIR RUN

Opens `DIR/store`, prints one `ready k=v ...` line with the recovery report, then loops with two
writer threads. Every block's content is a function of its id (`expected_frame`), so the checker
recomputes what must be stored. `DIR/acks.log` records, with one O_APPEND write each:

    W id     before a put of block `id` starts (the block may exist afterwards)
    P id     after the put returned True (the block must exist, unless deleted later)
    D id     before a delete of block `id` starts (the block may be gone afterwards)
    M s gen  after put_manifest of session `s` at generation `gen` returned
"""

from __future__ import annotations

import os
import random
import sys
import threading
from pathlib import Path

import numpy as np

from kvstore.frame import CodecId, Compression, DType, build_frame
from kvstore.keys import BlockHash, BlockKey, Namespace, SessionKey, validate_session_id
from kvstore.manifest import SessionManifest
from kvstore.tiers.nvme.tier import NvmeTier

__all__ = ["block_key", "expected_frame", "manifest_for", "session_key", "BUDGET", "SESSIONS"]

FINGERPRINT = bytes(range(100, 116))
NAMESPACE = Namespace("crash")
BUDGET = 1 << 40  # never evicts, so every acknowledged block must survive
SESSIONS = 3
_LAYERS = 4


def block_key(block_id: int) -> BlockKey:
    return BlockKey(FINGERPRINT, NAMESPACE, BlockHash(block_id.to_bytes(8, "little")))


def expected_frame(block_id: int) -> bytes:
    """The one frame ever written for `block_id`: sizes 4 KiB to ~1 MiB, so kills land mid-write."""
    rng = np.random.default_rng(block_id)
    # Mostly small blocks (many puts per run), some large ones (long writes to kill).
    seg = 1024 * int(rng.choice([1, 4, 16, 64, 256], p=[0.3, 0.3, 0.2, 0.12, 0.08]))
    segments = [(rng.bytes(seg), Compression.NONE, seg) for _ in range(_LAYERS)]
    return build_frame(segments, codec=CodecId.RAW, dtype=DType.FLOAT16, layout_id="nhd",
                       token_count=16, layer_shape=(16, 1, seg // 32),
                       key_digest=block_key(block_id).digest)


def session_key(session: int) -> SessionKey:
    return SessionKey(FINGERPRINT, NAMESPACE, validate_session_id(f"session-{session}"))


def manifest_for(session: int, generation: int) -> SessionManifest:
    hashes = tuple(BlockHash(bytes([session, generation % 256, i])) for i in range(generation % 7))
    return SessionManifest(session_key(session), hashes, token_count=16 * len(hashes),
                           generation=generation, updated_at=float(generation))


def _loop(tier: NvmeTier, log_fd: int, run: int, thread: int) -> None:
    rng = random.Random(run * 100 + thread)
    next_id = run * 1_000_000 + thread * 100_000
    done: list[int] = []

    def note(line: str) -> None:
        os.write(log_fd, line.encode())

    while True:
        action = rng.random()
        if action < 0.15:
            ids = list(range(next_id, next_id + 4))
            next_id += 4
            note("".join(f"W {i}\n" for i in ids))
            flags = tier.put_many([(block_key(i), expected_frame(i)) for i in ids])
            note("".join(f"P {i}\n" for i, ok in zip(ids, flags, strict=True) if ok))
            done.extend(ids)
        elif action < 0.22 and done:
            victim = done.pop(rng.randrange(len(done)))
            note(f"D {victim}\n")
            tier.delete([block_key(victim)])
        elif action < 0.3 and thread == 0:
            session = rng.randrange(SESSIONS)
            current = tier.get_manifest(session_key(session))
            generation = (current.generation if current else 0) + 1
            tier.put_manifest(manifest_for(session, generation))
            note(f"M {session} {generation}\n")
            if generation > 2:  # a stale writer: must never roll the session back
                tier.put_manifest(manifest_for(session, generation - 2))
        else:
            block_id = next_id
            next_id += 1
            note(f"W {block_id}\n")
            if tier.put(block_key(block_id), expected_frame(block_id)):
                note(f"P {block_id}\n")
            done.append(block_id)


def main(argv: list[str]) -> None:
    base, run = Path(argv[0]), int(argv[1])
    tier = NvmeTier(base / "store", BUDGET, min_free_bytes=0)
    r = tier.recovery
    print(f"ready blocks={r.blocks} temp_removed={r.temp_removed} "
          f"invalid_removed={r.invalid_removed} unreadable={r.unreadable}", flush=True)
    log_fd = os.open(base / "acks.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    threads = [threading.Thread(target=_loop, args=(tier, log_fd, run, n), daemon=True)
               for n in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


if __name__ == "__main__":
    main(sys.argv[1:])
