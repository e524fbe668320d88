"""The bounded load of a chaos run: scripted sessions, their references, and rounds of turns.

Each session is a scripted conversation (a system prompt and one user message per round).
Before anything is killed, every answer's reference is computed through the router with a
cache salt and no session id: unbroken, non-streamed requests on a healthy cluster, sharing no
KV with the sessions under test. During the run each round sends every session's next turn at
once, streamed with the `openai` client; a turn passes when its text equals its reference.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from deploy.conversation import ChatSession, Message, Turn, reference_answer

__all__ = ["RoundsSessionScript", "scripts", "compute_references", "open_sessions",
           "RoundResult", "run_round", "InFlight"]

_SYSTEM = ("You are a careful assistant. Permission is hereby granted, free of charge, to any "
           "person obtaining a copy of this software and associated documentation files.")
_QUESTIONS = (
    "What does the license say about distributing modified versions of the Program?",
    "Explain the conditions of the warranty disclaimer in plain words.",
    "THE SOFTWARE IS PROVIDED AS IS, WITHOUT WARRANTY OF ANY KIND. Why?",
    "Who may copy, modify, merge, publish and distribute copies of the Software?",
    "What happens to the patent license if you sue a contributor?",
    "Must the copyright notice be included in all copies or substantial portions?",
    "Describe the terms for conveying object code in source form.",
    "Is this permission notice required in binary distributions as well?",
)


@dataclass(frozen=True, slots=True)
class RoundsSessionScript:
    """One session of a `--kills` run: its id and one question per round (the scenario
    runner's sessions are `deploy.chaos.traffic.SessionScript`)."""

    session_id: str
    questions: tuple[str, ...]


def scripts(count: int, rounds: int, seed: int) -> list[RoundsSessionScript]:
    """`count` conversations of `rounds` questions each, chosen by `seed`."""
    rng = random.Random(seed)
    return [RoundsSessionScript(f"chaos-{seed}-{i}", tuple(rng.choice(_QUESTIONS)
                                                           for _ in range(rounds)))
            for i in range(count)]


def compute_references(router_url: str, model: str, plan: list[RoundsSessionScript],
                       max_tokens: int) -> dict[str, list[str]]:
    """Every session's reference answers, turn by turn (sessions in parallel)."""

    def one(script: RoundsSessionScript) -> list[str]:
        messages: list[Message] = [{"role": "system", "content": _SYSTEM}]
        answers: list[str] = []
        for question in script.questions:
            messages.append({"role": "user", "content": question})
            answer = reference_answer(router_url, messages, max_tokens, model=model)
            messages.append({"role": "assistant", "content": answer})
            answers.append(answer)
        return answers

    with ThreadPoolExecutor(max(1, min(4, len(plan)))) as pool:
        return dict(zip((s.session_id for s in plan), pool.map(one, plan), strict=True))


def open_sessions(router_url: str, model: str, plan: list[RoundsSessionScript]
                  ) -> dict[str, ChatSession]:
    return {s.session_id: ChatSession(router_url, s.session_id, model=model, system=_SYSTEM)
            for s in plan}


@dataclass
class InFlight:
    """Streams of the current round that have started and not ended, with their chunk counts:
    the killer waits for live streams, so that a kill interrupts generation."""

    _chunks: dict[str, int] = field(default_factory=dict)
    _workers: dict[str, str] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    started: threading.Event = field(default_factory=threading.Event)

    def progress(self, session_id: str, chunks: int, worker: str | None) -> None:
        with self._lock:
            self._chunks[session_id] = chunks
            if worker is not None:
                self._workers[session_id] = worker
        self.started.set()

    def finish(self, session_id: str) -> None:
        with self._lock:
            self._chunks.pop(session_id, None)
            self._workers.pop(session_id, None)

    def busy_workers(self) -> set[str]:
        """Workers that started a stream still running (as the router first placed it)."""
        with self._lock:
            return set(self._workers.values())

    def most_chunks(self) -> int:
        with self._lock:
            return max(self._chunks.values(), default=0)

    def live(self) -> int:
        with self._lock:
            return len(self._chunks)


@dataclass(frozen=True, slots=True)
class RoundResult:
    index: int
    turns: dict[str, Turn]
    expected: dict[str, str]

    @property
    def mismatched(self) -> list[str]:
        return [sid for sid, t in self.turns.items()
                if t.error is not None or t.text != self.expected[sid]]

    @property
    def resumed(self) -> int:
        return sum(1 for t in self.turns.values() if t.resumptions)


def run_round(index: int, sessions: dict[str, ChatSession], plan: list[RoundsSessionScript],
              references: dict[str, list[str]], max_tokens: int, in_flight: InFlight,
              during: Callable[[], None] | None = None) -> RoundResult:
    """Every session's turn `index` at once; `during` runs beside them (the killer)."""
    turns: dict[str, Turn] = {}

    def one(script: RoundsSessionScript) -> None:
        sid = script.session_id
        session = sessions[sid]
        try:
            turns[sid] = session.ask(
                script.questions[index], max_tokens,
                on_chunk=lambda n: in_flight.progress(sid, n, session.serving_worker))
        finally:
            in_flight.finish(sid)

    threads = [threading.Thread(target=one, args=(s,), name=f"turn-{s.session_id}")
               for s in plan]
    for t in threads:
        t.start()
    if during is not None:
        during()
    for t in threads:
        t.join()
    return RoundResult(index, turns, {s.session_id: references[s.session_id][index]
                                      for s in plan})
