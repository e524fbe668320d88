"""Workers: what one registers (`WorkerInfo`), what its metrics say (`WorkerLoad`), and the
router's live view of all of them (`WorkerPool` of `WorkerState`).

`WorkerInfo` and `WorkerLoad` cross boundaries (etcd, the scraper) and are frozen. `WorkerState`
is the router's own mutable record, read by the decision pipeline without copying: decisions
run on the event loop's thread, between awaits, so nothing else mutates it meanwhile.

Optimistic load accounting: a pick charges the worker at once (`charge`), so a burst of
requests arriving between two metric scrapes spreads out instead of piling onto the worker that
looked idle at the last scrape. The charge since the last scrape is dropped when a fresh scrape
arrives (the scrape now counts those requests); the in-flight count is kept until the response
ends, because it is this replica's exact knowledge.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import NewType

from kvstore.cluster.records import flag, json_object, opt_number, opt_text, text, texts
from kvstore.errors import ConfigError, UntrustedRegistration

__all__ = ["WorkerId", "WorkerInfo", "MalformedWorker", "WorkerLoad", "WorkerState",
           "WorkerPool"]

WorkerId = NewType("WorkerId", str)
_MAX_ID_CHARS = 128


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """A worker as registered in the state backend by its agent (or given on the command line).

    `gpu_mem_frac` and `gpu_temp_c` come from NVML on the worker's host where a GPU exists;
    `None` elsewhere.
    """

    worker_id: WorkerId
    url: str
    models: tuple[str, ...]
    kv_events: str | None = None
    draining: bool = False
    gpu_mem_frac: float | None = None
    gpu_temp_c: float | None = None

    def to_json(self) -> bytes:
        return json.dumps(
            {
                "id": self.worker_id,
                "url": self.url,
                "models": list(self.models),
                "kv_events": self.kv_events,
                "draining": self.draining,
                "gpu_mem_frac": self.gpu_mem_frac,
                "gpu_temp_c": self.gpu_temp_c,
            },
            separators=(",", ":"),
        ).encode()

    @classmethod
    def from_json(cls, raw: bytes, worker_id: str | None = None) -> WorkerInfo:
        """Parse a registration; raises ConfigError whatever `raw` holds (deep nesting, wrong
        field types, binary: every field's type is checked here, not where it is used).

        `worker_id`: the id the etcd key names, the only one a record may claim; a value
        naming another id is refused (a copy under another key would otherwise re-point the
        real worker, and deleting the copy would not undo it).
        """
        what = "worker record"
        try:
            data = json_object(raw, what)
            claimed = text(data, "id", what)
            if worker_id is not None and claimed != worker_id:
                raise UntrustedRegistration(
                    "wrong-key", f"the record under {worker_id!r} claims the id {claimed!r}")
            _check_worker_id(claimed)
            return cls(
                worker_id=WorkerId(claimed),
                url=text(data, "url", what).rstrip("/"),
                models=texts(data, "models", what),
                kv_events=opt_text(data, "kv_events", what),
                draining=flag(data, "draining", what),
                gpu_mem_frac=opt_number(data, "gpu_mem_frac", what),
                gpu_temp_c=opt_number(data, "gpu_temp_c", what),
            )
        except UntrustedRegistration as exc:
            raise MalformedWorker(exc.reason, f"{what} {raw[:100]!r}: {exc}") from None
        except Exception as exc:  # anything else a value can make a parser raise
            raise MalformedWorker("malformed", f"{what} {raw[:100]!r}: {exc}") from None


class MalformedWorker(ConfigError):
    """A worker record that is not one (`reason`: the word it is counted under)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


def _check_worker_id(worker_id: str) -> None:
    """Ids become metric labels, log fields and etcd keys: short and printable only."""
    if not 0 < len(worker_id) <= _MAX_ID_CHARS or not worker_id.isprintable() or any(
            c.isspace() or c == "/" for c in worker_id):
        raise UntrustedRegistration("malformed", f"worker id {worker_id[:80]!r} is not a "
                                    f"printable name of at most {_MAX_ID_CHARS} characters")


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """One scrape of a worker's vLLM `/metrics`: requests running and waiting, KV-cache usage."""

    running: int
    waiting: int
    kv_usage: float
    scraped_at: float


_NO_LOAD = WorkerLoad(0, 0, 0.0, 0.0)


@dataclass(slots=True)
class WorkerState:
    """The router's live record of one worker (mutable, never shared outside the event loop)."""

    info: WorkerInfo
    load: WorkerLoad = _NO_LOAD
    # Requests this replica has in flight there, and their estimated tokens (prompt + max new).
    inflight: int = 0
    inflight_tokens: int = 0
    # Picks since the last scrape: the optimistic part of the queue estimate.
    pending: int = 0
    consecutive_failures: int = 0
    suspect_until: float = 0.0
    alive: bool = True

    @property
    def worker_id(self) -> WorkerId:
        return self.info.worker_id

    @property
    def queue(self) -> int:
        """Outstanding requests: the scrape's running + waiting, plus picks made since it.

        Never below this replica's own in-flight count, which is exact for its requests.
        """
        return max(self.load.running + self.load.waiting + self.pending, self.inflight)

    @property
    def waiting(self) -> int:
        """Requests queued behind the running batch (scraped waiting plus picks since)."""
        return self.load.waiting + self.pending

    @property
    def kv_usage(self) -> float:
        return self.load.kv_usage

    def usable(self, now: float) -> bool:
        """Alive, not draining and not recently failing."""
        return self.alive and not self.info.draining and now >= self.suspect_until


@dataclass(slots=True)
class WorkerPool:
    """All known workers by id, with optimistic accounting and failure tracking. `clock` is
    what suspicion times are measured on (the decisions' clock: `usable(now)`)."""

    failure_threshold: int = 3
    suspect_s: float = 5.0
    clock: Callable[[], float] = field(default=time.monotonic, repr=False)
    _workers: dict[WorkerId, WorkerState] = field(default_factory=dict)
    _models: frozenset[str] | None = None  # served models, until the next upsert or remove

    def __iter__(self) -> Iterator[WorkerState]:
        return iter(self._workers.values())

    def __len__(self) -> int:
        return len(self._workers)

    def __contains__(self, worker_id: object) -> bool:
        return worker_id in self._workers

    def get(self, worker_id: WorkerId) -> WorkerState | None:
        return self._workers.get(worker_id)

    def states(self) -> list[WorkerState]:
        return list(self._workers.values())

    def upsert(self, info: WorkerInfo) -> WorkerState:
        """Add a worker or replace its registration, keeping its load and accounting."""
        self._models = None
        state = self._workers.get(info.worker_id)
        if state is None:
            state = WorkerState(info)
            self._workers[info.worker_id] = state
        else:
            state.info = info
            state.alive = True
        return state

    def remove(self, worker_id: WorkerId) -> WorkerState | None:
        """Forget a worker (its lease expired or it deregistered)."""
        self._models = None
        state = self._workers.pop(worker_id, None)
        if state is not None:
            state.alive = False
        return state

    def models(self) -> frozenset[str]:
        """Models some registered worker serves (asked on every request: kept until the
        workers change)."""
        if self._models is None:
            self._models = frozenset(m for s in self._workers.values() if s.alive
                                     for m in s.info.models)
        return self._models

    def update_load(self, worker_id: WorkerId, load: WorkerLoad) -> None:
        state = self._workers.get(worker_id)
        if state is not None:
            state.load = load
            state.pending = 0

    def charge(self, worker_id: WorkerId, tokens: int) -> None:
        """Account a request sent to a worker before its metrics can show it."""
        state = self._workers.get(worker_id)
        if state is not None:
            state.inflight += 1
            state.inflight_tokens += tokens
            state.pending += 1

    def release(self, worker_id: WorkerId, tokens: int) -> None:
        """A request ended (done, failed or moved elsewhere)."""
        state = self._workers.get(worker_id)
        if state is not None:
            state.inflight = max(0, state.inflight - 1)
            state.inflight_tokens = max(0, state.inflight_tokens - tokens)
            state.pending = max(0, state.pending - 1)

    def record_success(self, worker_id: WorkerId) -> None:
        state = self._workers.get(worker_id)
        if state is not None:
            state.consecutive_failures = 0

    def record_failure(self, worker_id: WorkerId, *, hard: bool = False) -> bool:
        """Count a connection failure; returns True when this failure made the worker suspect.

        A broken stream (`hard`) makes the worker suspect at once: waiting for two more
        failures would send the next sessions into the same dead socket while its lease runs.
        """
        state = self._workers.get(worker_id)
        if state is None:
            return False
        state.consecutive_failures += 1
        if hard or state.consecutive_failures >= self.failure_threshold:
            now = self.clock()
            was_suspect = now < state.suspect_until
            state.suspect_until = now + self.suspect_s
            return not was_suspect
        return False
