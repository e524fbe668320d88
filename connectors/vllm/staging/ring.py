"""A ring of staging slots: host and device buffers allocated once, handed out in turn.

A slot is one batch of blocks on its way between the store and the paged KV cache: `host`, a
flat host buffer (page-locked on a GPU, so its copies are DMAs), and `device`, as many bytes
on the caches' device. For host caches (vLLM's CPU backend) the two are one buffer, so the
"link" copy costs nothing (`Slot.shared`). A batch sees a slot as rows of one width (`rows`):
a block's layer range, or a whole frame.

Nothing is allocated per block or per batch: a pipeline takes a slot (`acquire`),
fills and ships it, and gives it back (`release`) with the event after which the slot's last
device work is done; the next taker waits for that event before it writes into the slot.

Back-pressure: when every slot is out, `acquire` blocks until one comes back, so a slow store
or a slow link slows the pipeline instead of growing memory. A blocked `acquire` gives up as
soon as its caller's `cancelled()` says so (a restore past its deadline), raising `Cancelled`.
`try_acquire` never blocks: a pipeline that already holds a slot finishes that one rather than
wait for another, so two jobs sharing a ring can never wait for each other.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from connectors.vllm.staging.streams import Event, host_buffer
from kvstore.errors import KVKeepError

__all__ = ["Cancelled", "Slot", "StagingRing", "split"]

_POLL_S = 0.02  # how often a blocked acquire looks at its caller's cancellation


class Cancelled(KVKeepError):
    """The caller gave up while waiting for a staging slot."""


@dataclass(eq=False, slots=True)
class Slot:
    """One batch's buffers; owned by whoever acquired it until released."""

    index: int
    host: torch.Tensor
    device: torch.Tensor
    reusable_after: Event | None = None
    """Device work that still reads or writes this slot; its next owner waits for it."""

    @property
    def nbytes(self) -> int:
        return int(self.host.numel())

    @property
    def shared(self) -> bool:
        """Whether host and device are one buffer (host caches): nothing to copy between."""
        return self.host.data_ptr() == self.device.data_ptr()

    def capacity(self, width: int) -> int:
        """How many rows of `width` bytes fit."""
        return self.nbytes // width

    def rows(self, count: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `count` rows of `width` bytes, contiguous, on the host and the device."""
        if count * width > self.nbytes:
            raise ValueError(f"{count} rows of {width} bytes do not fit {self.nbytes}")
        return (self.host[: count * width].view(count, width),
                self.device[: count * width].view(count, width))


class StagingRing:
    def __init__(self, *, slots: int, slot_bytes: int, device: torch.device,
                 pinned: bool) -> None:
        if slots < 1 or slot_bytes < 1:
            raise ValueError(f"a staging ring needs slots and bytes, got {slots}, {slot_bytes}")
        on_host = device.type == "cpu"
        self._slots = []
        for i in range(slots):
            host = host_buffer((slot_bytes,), pinned=pinned and not on_host)
            self._slots.append(Slot(i, host, host if on_host else
                                    torch.empty(slot_bytes, dtype=torch.uint8, device=device)))
        self._free = list(reversed(self._slots))
        self._cond = threading.Condition()
        self.allocations = slots if on_host else 2 * slots
        """Buffers allocated, all at construction: a test reads it to see none come later."""
        self.waits = 0
        """How many acquires found every slot out and waited (back-pressure)."""

    @property
    def capacity(self) -> int:
        return len(self._slots)

    @property
    def slot_bytes(self) -> int:
        return self._slots[0].nbytes

    @property
    def free(self) -> int:
        with self._cond:
            return len(self._free)

    def try_acquire(self) -> Slot | None:
        """A free slot, ready to be written, or None at once if every slot is out."""
        with self._cond:
            slot = self._free.pop() if self._free else None
        if slot is not None:
            self._ready(slot)
        return slot

    def acquire(self, cancelled: Callable[[], bool]) -> Slot:
        """A free slot, waiting while none is; `Cancelled` once `cancelled()` is true."""
        with self._cond:
            if not self._free:
                self.waits += 1
            while not self._free:
                if cancelled():
                    raise Cancelled("gave up waiting for a staging slot")
                self._cond.wait(_POLL_S)
            slot = self._free.pop()
        self._ready(slot)
        return slot

    def release(self, slot: Slot, after: Event | None = None) -> None:
        """Give `slot` back; its next owner first waits for `after` (device work on it)."""
        slot.reusable_after = after
        with self._cond:
            if any(free is slot for free in self._free):
                raise RuntimeError(f"staging slot {slot.index} released twice")
            self._free.append(slot)
            self._cond.notify()

    @staticmethod
    def _ready(slot: Slot) -> None:
        event, slot.reusable_after = slot.reusable_after, None
        if event is not None:
            event.synchronize()


def split(count: int, parts: int) -> list[range]:
    """Rows [0, count) of a batch in up to `parts` contiguous ranges: one pool task each
    (a task per block would cost more in scheduling than a block's hash)."""
    step = max(1, -(-count // parts))
    return [range(i, min(count, i + step)) for i in range(0, count, step)]
