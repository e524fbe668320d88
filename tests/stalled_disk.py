"""A disk that stalls on cue: an NVMe tier's `write_fn` held while the gate is closed."""

from __future__ import annotations

import threading

from kvstore.tiers.nvme.durable_files import write_chunked

__all__ = ["DiskGate"]


class DiskGate:
    """The NVMe tier's file writes, held while the gate is closed (a stalled disk). Pass
    `gate.write` as the tier's `write_fn`; `gate.open.clear()` stalls, `.set()` resumes."""

    def __init__(self) -> None:
        self.open = threading.Event()
        self.open.set()

    def write(self, fd: int, data: memoryview) -> None:
        self.open.wait(60)
        write_chunked(fd, data)
