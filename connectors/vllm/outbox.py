"""What the worker half owes vLLM and the scheduler half after each step, collected from the
loader and saver threads: save outcomes, probe answers, load reports, blocks that failed to
load, and requests whose async load or delayed-free save finished."""

from __future__ import annotations

import threading
from collections.abc import Iterable

from connectors.vllm.metadata import LoadReport, ProbeAnswer, SaveReport, WorkerReport

__all__ = ["WorkerOutbox"]


class WorkerOutbox:
    """Thread-safe; every `take_*` hands over what accumulated and starts afresh."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._saves: list[SaveReport] = []
        self._answers: list[ProbeAnswer] = []
        self._loads: list[LoadReport] = []
        self._load_errors: set[int] = set()
        self._sending: set[str] = set()
        self._recving: set[str] = set()

    def saves(self, reports: Iterable[SaveReport]) -> None:
        with self._lock:
            self._saves.extend(reports)

    def answer(self, answer: ProbeAnswer) -> None:
        with self._lock:
            self._answers.append(answer)

    def loads(self, reports: Iterable[LoadReport], failed_block_ids: Iterable[int]) -> None:
        with self._lock:
            self._loads.extend(reports)
            self._load_errors.update(failed_block_ids)

    def finished_sending(self, req_id: str) -> None:
        """A finished request's blocks are no longer needed by a save: vLLM may free them."""
        with self._lock:
            self._sending.add(req_id)

    def finished_recving(self, req_ids: Iterable[str]) -> None:
        """Async loads that are done: vLLM may schedule these requests."""
        with self._lock:
            self._recving.update(req_ids)

    def take_report(self) -> WorkerReport | None:
        with self._lock:
            saves, self._saves = self._saves, []
            answers, self._answers = self._answers, []
            loads, self._loads = self._loads, []
        if not (saves or answers or loads):
            return None
        return WorkerReport(tuple(saves), tuple(answers), tuple(loads))

    def take_load_errors(self) -> set[int]:
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    def take_finished(self) -> tuple[set[str] | None, set[str] | None]:
        with self._lock:
            sending, self._sending = self._sending, set()
            recving, self._recving = self._recving, set()
        return sending or None, recving or None
