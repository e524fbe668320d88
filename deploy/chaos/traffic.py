"""The load of a scenario: scripted sessions, their reference answers, and the paced run.

Each session is a conversation: a system prompt (one of `shared_prefixes`, so sessions share
prefixes as a product's users share its system prompt) and `turns` user messages of drawn
lengths, each answered in a drawn number of tokens. All of it is drawn from the scenario's seed.

References come first, on the healthy cluster: every turn of every session as one unbroken,
non-streamed request with a cache salt and no session id (greedy, `ignore_eos`), each turn's
history built from the reference answers before it. The salt keeps the references from reading
or warming the KV the sessions use.

Then the run: session `i` sends turn `k` at `start + (i / sessions + k) * duration_s / turns`
(or when its previous turn ends, if later), at most `concurrency` turns in flight, each streamed
through `ChaosSession` (router pool, retries on another replica).
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial

from deploy.chaos.client import ChaosSession, RouterPool, TurnRecord
from deploy.chaos.scenario import LoadPlan
from deploy.conversation import Message, reference_answer

__all__ = ["SessionScript", "make_scripts", "compute_references", "Streams", "LoadRun"]

# Licence prose: the tiny model's tokenizer was trained on licence texts, so these words
# tokenize compactly and every span of them is a plausible prompt.
_CORPUS = (  # noqa: SIM905 (prose reads better than a list of words)
    "Permission is hereby granted, free of charge, to any person obtaining a copy of this "
    "software and associated documentation files (the Software), to deal in the Software "
    "without restriction, including without limitation the rights to use, copy, modify, merge, "
    "publish, distribute, sublicense, and/or sell copies of the Software, and to permit persons "
    "to whom the Software is furnished to do so, subject to the following conditions: The above "
    "copyright notice and this permission notice shall be included in all copies or substantial "
    "portions of the Software. THE SOFTWARE IS PROVIDED AS IS, WITHOUT WARRANTY OF ANY KIND, "
    "EXPRESS OR IMPLIED, INCLUDING BUT NOT LIMITED TO THE WARRANTIES OF MERCHANTABILITY, FITNESS "
    "FOR A PARTICULAR PURPOSE AND NONINFRINGEMENT. The licenses for most software are designed "
    "to take away your freedom to share and change it. By contrast, the General Public License "
    "is intended to guarantee your freedom to share and change free software, to make sure the "
    "software is free for all its users. When we speak of free software, we are referring to "
    "freedom, not price. You may convey verbatim copies of the Program's source code as you "
    "receive it, in any medium, provided that you conspicuously and appropriately publish on "
    "each copy an appropriate copyright notice; keep intact all notices stating that this "
    "License and any non-permissive terms apply to the code; and give all recipients a copy of "
    "this License along with the Program. Each contributor grants you a non-exclusive, "
    "worldwide, royalty-free patent license under the contributor's essential patent claims, "
    "to make, use, sell, offer for sale, import and otherwise run, modify and propagate the "
    "contents of its contributor version. If you institute patent litigation against any "
    "entity, then any patent licenses granted to you under this License shall terminate."
).split()


@dataclass(frozen=True, slots=True)
class SessionScript:
    session_id: str
    system: str
    questions: tuple[str, ...]
    max_tokens: tuple[int, ...]


def _span(rng: random.Random, words: int) -> str:
    start = rng.randrange(len(_CORPUS))
    return " ".join(_CORPUS[(start + i) % len(_CORPUS)] for i in range(words))


def make_scripts(load: LoadPlan, seed: int, tag: str) -> list[SessionScript]:
    """The sessions of `load`, drawn from `seed`; ids carry `tag` (one run's sessions)."""
    rng = random.Random(seed)
    prefixes = [f"You are assistant number {p}. " + _span(rng, rng.randint(*load.prefix_words))
                for p in range(load.shared_prefixes)]
    return [SessionScript(
        session_id=f"{tag}-s{i}", system=prefixes[i % len(prefixes)],
        questions=tuple(_span(rng, rng.randint(*load.user_words)) for _ in range(load.turns)),
        max_tokens=tuple(rng.randint(*load.max_tokens) for _ in range(load.turns)))
        for i in range(load.sessions)]


def compute_references(router_url: str, model: str, scripts: list[SessionScript],
                       parallel: int = 4) -> dict[str, list[str]]:
    """Every session's reference answers, turn by turn (sessions in parallel)."""

    def one(script: SessionScript) -> list[str]:
        messages: list[Message] = [{"role": "system", "content": script.system}]
        answers: list[str] = []
        for question, max_tokens in zip(script.questions, script.max_tokens, strict=True):
            messages.append({"role": "user", "content": question})
            answer = reference_answer(router_url, messages, max_tokens, model=model)
            messages.append({"role": "assistant", "content": answer})
            answers.append(answer)
        return answers

    with ThreadPoolExecutor(max(1, min(parallel, len(scripts)))) as pool:
        return dict(zip((s.session_id for s in scripts), pool.map(one, scripts), strict=True))


class Streams:
    """Streams in flight now, by session: the worker the router placed each on, how many
    chunks it has sent and how many tokens it has left. A kill of a `busy` worker waits for
    one well under way and far from its end, so that it lands mid-answer."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: dict[str, tuple[str | None, int, int]] = {}

    def progress(self, session_id: str, max_tokens: int, worker: str | None, chunks: int
                 ) -> None:
        with self._lock:
            self._live[session_id] = (worker, chunks, max_tokens - chunks)

    def done(self, session_id: str) -> None:
        with self._lock:
            self._live.pop(session_id, None)

    def busy(self, min_chunks: int, min_left: int = 0) -> dict[str, int]:
        """Workers with a live stream past `min_chunks` chunks and at least `min_left` tokens
        from its end -> the most tokens such a stream has left."""
        out: dict[str, int] = {}
        with self._lock:
            for worker, chunks, left in self._live.values():
                if worker is not None and chunks >= min_chunks and left >= min_left:
                    out[worker] = max(out.get(worker, 0), left)
        return out

    def count(self) -> int:
        with self._lock:
            return len(self._live)


@dataclass
class LoadRun:
    """Runs every session's turns on the schedule above; `records` fills as turns end."""

    load: LoadPlan
    scripts: list[SessionScript]
    pool: RouterPool
    model: str
    seed: int
    streams: Streams = field(default_factory=Streams)
    records: list[TurnRecord] = field(default_factory=list)
    started: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _threads: list[threading.Thread] = field(default_factory=list)
    _slots: threading.Semaphore = field(init=False)
    _sessions: dict[str, ChaosSession] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._slots = threading.Semaphore(self.load.concurrency)

    def start(self) -> None:
        self.started = time.monotonic()
        for i, script in enumerate(self.scripts):
            session = ChaosSession(self.pool, script.session_id, script.system, model=self.model,
                                   timeout_s=self.load.turn_timeout_s, seed=self.seed)
            self._sessions[script.session_id] = session
            offset = i / len(self.scripts)
            thread = threading.Thread(target=self._run_session, args=(script, session, offset),
                                      name=f"chaos-{script.session_id}", daemon=True)
            self._threads.append(thread)
            thread.start()

    def wait(self, timeout_s: float, tick: Callable[[], None] = lambda: None) -> bool:
        """Wait for every session to end (True) or `timeout_s` to pass (False)."""
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            while thread.is_alive() and time.monotonic() < deadline:
                thread.join(0.5)
                tick()
        return not any(t.is_alive() for t in self._threads)

    def close(self) -> None:
        for session in self._sessions.values():
            session.close()

    @property
    def ended_at(self) -> float:
        with self._lock:
            return max((r.started_s + r.seconds for r in self.records), default=self.started)

    def _run_session(self, script: SessionScript, session: ChaosSession, offset: float) -> None:
        interval = self.load.duration_s / self.load.turns
        for k, (question, max_tokens) in enumerate(zip(script.questions, script.max_tokens,
                                                       strict=True)):
            due = self.started + (offset + k) * interval
            time.sleep(max(0.0, due - time.monotonic()))
            sid = script.session_id
            with self._slots:
                try:
                    record = session.ask(k, question, max_tokens,
                                         on_chunk=partial(self.streams.progress, sid,
                                                          max_tokens))
                finally:
                    self.streams.done(sid)
            with self._lock:
                self.records.append(record)
            if record.error is not None:
                return  # the conversation cannot go on without this answer: the session is lost
