"""What the restore pipeline works on: the connector's load jobs as protocols (the loader's
`LoadJob` is one, so is a benchmark's), the callables it is handed, and a block located in the
store (lent in place by the first tier, or read)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol

import torch

from connectors.vllm.stats import Count
from kvstore.frame import BlockRead, FrameHeader, LayerRange
from kvstore.keys import BlockKey
from kvstore.tiers.capabilities import BorrowedBlock

__all__ = ["BatchJob", "Located", "ReadLower", "Refusal", "RestoreBlock", "RestoreJob",
           "StagedBlock", "all_results"]


class RestoreBlock(Protocol):
    @property
    def block_id(self) -> int:
        """The paged block it goes to."""
        ...

    @property
    def key(self) -> BlockKey: ...


class RestoreJob(Protocol):
    """What the pipeline needs of a load (`connectors.vllm.loader.LoadJob` is one)."""

    @property
    def blocks(self) -> Sequence[RestoreBlock]: ...

    @property
    def failed(self) -> Mapping[int, Count]: ...

    @property
    def lock(self) -> threading.Lock: ...

    @property
    def cancelled(self) -> bool: ...

    @property
    def deadline(self) -> float: ...

    @property
    def layer_done(self) -> Sequence[threading.Event]: ...

    @property
    def device_done(self) -> list[torch.cuda.Event | None]: ...

    def fail(self, block_id: int, reason: Count) -> None: ...

    def still_on_time(self) -> bool:
        """Under `lock`: False once cancelled or late (and then it is cancelled)."""
        ...


ReadLower = Callable[[RestoreJob, LayerRange, Sequence[RestoreBlock]], list[BlockRead | None]]
"""The pipeline's reads of blocks not lent in place (the loader's threaded `get_many`, under
the job's deadline)."""
Refusal = Callable[[FrameHeader], tuple[Count, str] | None]
"""Why a frame's header refuses it (forged, or not one this engine would have written), as its
load counter and a reason; None when it may be restored."""


@dataclass(eq=False, slots=True)
class Located:
    """One block of a batch and where its bytes are."""

    block: RestoreBlock
    header: FrameHeader
    borrowed: BorrowedBlock | None = None
    read: BlockRead | None = None
    direct: bool = False
    """Copied to the device from its own page-locked pages (no host copy)."""

    def release(self) -> None:
        if self.borrowed is not None:
            self.borrowed.release()


def all_results(futures: Sequence[Future[list[tuple[int, Count]]]]
                ) -> list[list[tuple[int, Count]]]:
    """Every pool task's failures once all are done (none still touching a slot or a page);
    the first error after that."""
    errors = [future.exception() for future in futures]
    for error in errors:
        if error is not None:
            raise error
    return [future.result() for future in futures]


@dataclass(frozen=True, slots=True)
class StagedBlock:
    """A block to restore, for callers without the connector's loader (benchmarks, tests)."""

    block_id: int
    key: BlockKey


@dataclass(eq=False, slots=True)
class BatchJob:
    """A `RestoreJob` without vLLM (the loader's `LoadJob` needs vLLM's metadata types): every
    block of `blocks` under one deadline (`time.monotonic()`)."""

    blocks: Sequence[StagedBlock]
    deadline: float
    num_layers: int
    lock: threading.Lock = field(default_factory=threading.Lock)
    cancelled: bool = False
    failed: dict[int, Count] = field(default_factory=dict)
    layer_done: list[threading.Event] = field(default_factory=list)
    device_done: list[torch.cuda.Event | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.layer_done = [threading.Event() for _ in range(self.num_layers)]
        self.device_done = [None] * self.num_layers

    def fail(self, block_id: int, reason: Count) -> None:
        self.failed.setdefault(block_id, reason)

    def still_on_time(self) -> bool:
        if self.cancelled:
            return False
        if time.monotonic() > self.deadline:
            self.cancelled = True
            for block in self.blocks:
                self.fail(block.block_id, Count.LOAD_LATE)
            return False
        return True
