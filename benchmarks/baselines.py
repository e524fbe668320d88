"""The machine's own ceilings, measured in the same run as what they are compared with.

These machines are noisy, so every benchmark reports ratios against these figures rather than
absolute times. Each function returns GB/s (10^9 bytes per second), the median of `repeats`.
"""

from __future__ import annotations

import os
import socket
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

__all__ = ["median_gbps", "memcpy_gbps", "disk_write_fsync_gbps", "disk_cold_read_gbps",
           "file_create_us", "tcp_loopback_gbps", "drop_file_cache", "gemm_gflops"]


def median_gbps(nbytes: int, run: Callable[[], object], repeats: int = 5) -> float:
    """Median throughput of `run`, which moves `nbytes` per call, after one untimed warm-up
    (the first run pays for page faults, file creation and readahead state)."""
    run()
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        rates.append(nbytes / (time.perf_counter() - start) / 1e9)
    return statistics.median(rates)


def memcpy_gbps(nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """np.copyto into an already-touched buffer: the ceiling for any in-RAM copy."""
    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # touch every page once so page faults are not measured
    return median_gbps(nbytes, lambda: np.copyto(dst, src), repeats)


def drop_file_cache(path: Path) -> None:
    """Evict one file's pages from the page cache, so the next read comes from the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def disk_write_fsync_gbps(directory: Path, block_bytes: int = 4 << 20, blocks: int = 64,
                          repeats: int = 3) -> float:
    """Write `blocks` files of `block_bytes` each, fsync each: what a durable block put costs."""
    payload = memoryview(np.random.default_rng(1).integers(0, 255, block_bytes, dtype=np.uint8))
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        counter = [0]

        def run() -> None:
            for _ in range(blocks):
                counter[0] += 1
                fd = os.open(Path(tmp) / f"b{counter[0]}", os.O_WRONLY | os.O_CREAT, 0o644)
                try:
                    os.write(fd, payload)
                    os.fsync(fd)
                finally:
                    os.close(fd)

        return median_gbps(block_bytes * blocks, run, repeats)


def file_create_us(directory: Path, files: int = 256) -> float:
    """Microseconds to create one empty file (O_CREAT | O_EXCL, by directory fd) in a fresh
    directory: the fixed cost of a tier that keeps a file per block, before any byte is
    written. Machines differ by 10x and more here: an ext4 without a journal (this one's root)
    skips every inode freed in the last minutes one by one when it allocates a new one
    (`recently_deleted` under `find_inode_bit`, perf), so its cost follows how many files
    were deleted lately near the directory."""
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        dir_fd = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY)
        try:
            started = time.perf_counter()
            for i in range(files):
                os.close(os.open(f"f{i}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644,
                                 dir_fd=dir_fd))
            return (time.perf_counter() - started) / files * 1e6
        finally:
            os.close(dir_fd)


def disk_cold_read_gbps(directory: Path, block_bytes: int = 4 << 20, blocks: int = 64,
                        repeats: int = 3) -> float:
    """Sequential read of one file of `blocks` x `block_bytes`, evicted from the page cache
    first, in `block_bytes` reads into one reused buffer: the disk's own streaming ceiling
    (stricter than reading one small file per block, which is what a block store must do)."""
    out = bytearray(block_bytes)
    view = memoryview(out)
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        path = Path(tmp) / "seq"
        chunk = np.random.default_rng(2).integers(0, 255, block_bytes, dtype=np.uint8).tobytes()
        with path.open("wb") as f:
            for _ in range(blocks):
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())

        def run() -> None:
            drop_file_cache(path)
            fd = os.open(path, os.O_RDONLY)
            try:
                for i in range(blocks):
                    os.preadv(fd, [view], i * block_bytes)
            finally:
                os.close(fd)

        return median_gbps(block_bytes * blocks, run, repeats)


def tcp_loopback_gbps(message_bytes: int = 4 << 20, messages: int = 64, repeats: int = 3) -> float:
    """One TCP stream over 127.0.0.1, sender and receiver in two threads, reused buffers."""
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    total = message_bytes * messages

    def receive(conn: socket.socket) -> None:
        buf = bytearray(message_bytes)
        view = memoryview(buf)
        remaining = total
        while remaining:
            n = conn.recv_into(view, min(len(view), remaining))
            if n == 0:
                break
            remaining -= n

    client = socket.create_connection(("127.0.0.1", port))
    conn, _ = server.accept()
    payload = memoryview(bytearray(os.urandom(message_bytes)))
    try:
        def run() -> None:
            receiver = threading.Thread(target=receive, args=(conn,))
            receiver.start()
            for _ in range(messages):
                client.sendall(payload)
            receiver.join()

        return median_gbps(total, run, repeats)
    finally:
        client.close()
        conn.close()
        server.close()


def gemm_gflops(dtype: str, m: int = 512, k: int = 1024, n: int = 2816, repeats: int = 3
                ) -> float:
    """torch's linear layer (`F.linear`, what vLLM's CPU linear layers fall back to when oneDNN
    has no kernel) in `dtype` ("float32", "bfloat16") on the threads torch has (the engines'
    own setting), GFLOP/s, median of `repeats`: the ceiling of a CPU prefill. Not GB/s like
    the rest: recompute is bound by it, and it differs by far more than noise between machines
    (2026-12-07, one thread, an AVX2-only AMD EPYC, torch 2.13: a float32 linear of this shape
    ran at 53-82 GFLOP/s and a bfloat16 one at 8-10; `torch.mm` in bfloat16 at 0.8)."""
    import torch

    x = torch.randn(m, k).to(getattr(torch, dtype))
    weight = torch.randn(n, k).to(getattr(torch, dtype))
    return median_gbps(2 * m * k * n, lambda: torch.nn.functional.linear(x, weight), repeats)
