"""Copy lanes: a CUDA stream and its events on a GPU, the same calls as no-ops on the host.

The staging pipelines (`restore`, `save`) issue every device copy and kernel on a `Lane` and
order them with `Event`s. On a GPU a lane is its own `torch.cuda.Stream`, so copies run beside
the forward pass and beside the host threads that hash and verify; on the host (vLLM's CPU
backend, and the tests here) work is done when the call returns, a lane's events are complete
from the start, and waiting on one returns at once. The pipeline's logic (ordering, buffer
reuse, back-pressure, cancellation) is the same code on both.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Protocol

import torch

__all__ = ["Event", "Lane", "lane_for", "host_buffer", "is_cuda_event"]


class Event(Protocol):
    """A point in a lane's work: `synchronize` blocks the calling thread until it is done."""

    def synchronize(self) -> None: ...

    def query(self) -> bool: ...


class Lane(Protocol):
    """Where a pipeline's device work is queued, in order."""

    @property
    def device(self) -> torch.device: ...

    def activate(self) -> contextlib.AbstractContextManager[object]:
        """Make this lane the calling thread's current stream (torch ops queue on it)."""
        ...

    def record(self) -> Event:
        """An event that completes once everything queued on this lane so far has."""
        ...

    def wait(self, event: Event) -> None:
        """Later work on this lane starts only after `event` (on the device; the caller does
        not block)."""
        ...


class _Done:
    """The host's event: work on a host lane is finished when its call returns."""

    __slots__ = ()

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


_DONE = _Done()


class _HostLane:
    def __init__(self, device: torch.device) -> None:
        self._device = device

    @property
    def device(self) -> torch.device:
        return self._device

    @contextlib.contextmanager
    def activate(self) -> Iterator[object]:
        yield None

    def record(self) -> Event:
        return _DONE

    def wait(self, event: Event) -> None:
        event.synchronize()  # a device event handed to a host lane: honour it


class _CudaLane:
    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]

    @property
    def device(self) -> torch.device:
        return self._device

    def activate(self) -> contextlib.AbstractContextManager[object]:
        return torch.cuda.stream(self._stream)

    def record(self) -> Event:
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch leaves it untyped
        event.record(self._stream)
        return event

    def wait(self, event: Event) -> None:
        if isinstance(event, torch.cuda.Event):
            self._stream.wait_event(event)
        else:
            event.synchronize()


def lane_for(device: torch.device) -> Lane:
    """A new lane for work on `device`: its own CUDA stream there, or the host's no-op lane."""
    if device.type == "cuda":
        return _CudaLane(device)
    return _HostLane(device)


def is_cuda_event(event: Event) -> bool:
    """Whether `event` is a CUDA event (another stream can wait for it on the device)."""
    return isinstance(event, torch.cuda.Event)


def host_buffer(shape: tuple[int, ...], *, pinned: bool) -> torch.Tensor:
    """A uint8 host tensor allocated (and touched) once: page-locked where `pinned`, so copies
    to and from a GPU are DMAs that run asynchronously."""
    buffer = torch.empty(shape, dtype=torch.uint8, pin_memory=pinned)
    buffer.zero_()  # fault every page in now, not during the first copy into it
    return buffer
