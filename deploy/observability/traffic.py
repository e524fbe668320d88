"""A short, bounded run against a local cluster that makes every dashboard panel move: chat
sessions that checkpoint and restore, a worker SIGKILLed in the middle of a streamed answer
(the router resumes it elsewhere and rebinds its sessions, which restore from the daemons), the
worker back (unless asked not to), more turns.

Used by the observability test (every metric the dashboard and alerts name must then be in a
real Prometheus) and by `python -m deploy.observability.snapshot` (the README's picture).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from deploy.local.cluster import LocalCluster

__all__ = ["RunLog", "exercise"]

_SYSTEM = ("You are a careful assistant for a storage team. Answer in full sentences and keep "
           "the notes of earlier turns in mind. ") * 6


@dataclass
class RunLog:
    """What the run did (for assertions and the picture's caption)."""

    started: float = field(default_factory=time.time)
    ended: float = 0.0
    turns: int = 0
    killed: str | None = None
    resumed: bool = False
    restored_turns: int = 0
    events: list[tuple[float, str]] = field(default_factory=list)

    def note(self, what: str) -> None:
        self.events.append((time.time(), what))


def _turn(http: httpx.Client, url: str, session: str, history: list[dict[str, str]],
          question: str, max_tokens: int, log: RunLog) -> httpx.Response:
    history.append({"role": "user", "content": question})
    reply = http.post(f"{url}/v1/chat/completions", headers={"X-Session-Id": session}, json={
        "model": "tiny", "messages": history, "max_tokens": max_tokens, "temperature": 0})
    reply.raise_for_status()
    history.append({"role": "assistant",
                    "content": reply.json()["choices"][0]["message"]["content"]})
    log.turns += 1
    if reply.headers.get("X-KVKeep-Restore") == "1":
        log.restored_turns += 1
    return reply


def _stream_and_kill(http: httpx.Client, cluster: LocalCluster, session: str,
                     history: list[dict[str, str]], log: RunLog,
                     on_kill: Callable[[str], None]) -> None:
    history.append({"role": "user", "content": "Now write a long report of everything."})
    chunks, text = 0, []
    with http.stream("POST", f"{cluster.router_url}/v1/chat/completions",
                     headers={"X-Session-Id": session},
                     # ignore_eos (vLLM's extension): all 240 tokens come, so the kill after 30
                     # chunks finds 210 still to generate, however far the client reads behind
                     # the engine (a CI-like run missed its resumption, most likely because the
                     # random-weight model stopped early and the loaded client read behind).
                     json={"model": "tiny", "messages": history, "max_tokens": 240,
                           "temperature": 0, "stream": True, "ignore_eos": True}) as reply:
        reply.raise_for_status()
        worker = reply.headers.get("X-KVKeep-Worker", "")
        for line in reply.iter_lines():
            if line.startswith(": kvkeep"):
                log.resumed = True
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunks += 1
            text.append(line)
            if chunks == 30 and worker in cluster.workers and log.killed is None:
                cluster.kill_worker(worker)
                log.killed = worker
                log.note(f"SIGKILL {worker} mid-stream")
                on_kill(worker)
    history.append({"role": "assistant", "content": "(long report)"})
    log.turns += 1


def exercise(cluster: LocalCluster, *, sessions: int = 4, say: Callable[[str], None] = print,
             restart_killed: bool = True) -> RunLog:
    """The run (about a minute on two loaded cores, plus a worker restart). Without
    `restart_killed` the killed worker stays down (the picture shows it back; a check of what
    is exported needs no second start of the same server, ~20 s of vLLM start-up here)."""
    log = RunLog()
    histories = {f"s{i}": [{"role": "system", "content": _SYSTEM}] for i in range(sessions)}
    with httpx.Client(timeout=120) as http:
        say("first turns: every session checkpoints its prompt")
        placed: dict[str, str] = {}
        for round_ in range(2):
            for session, history in histories.items():
                reply = _turn(http, cluster.router_url, session, history,
                              f"Turn {round_}: summarise the state of block {session}.", 16,
                              log)
                placed[session] = reply.headers.get("X-KVKeep-Worker", "")
        log.note(f"sessions warm on {placed}")
        # The streamed session is one of the busiest worker's, so that the kill leaves other
        # sessions to fail over with a restore: with the prefix index fed by KV events, the
        # router may put every session sharing the system prompt on one worker, and a lone
        # session on the other would leave no turn to restore.
        busiest = Counter(placed.values()).most_common(1)[0][0]
        streamed = next(s for s, w in placed.items() if w == busiest)
        say("a streamed answer; its worker is SIGKILLed after 30 chunks")
        _stream_and_kill(http, cluster, streamed, histories[streamed], log,
                         on_kill=lambda w: say(f"killed {w}"))
        time.sleep(cluster.spec.lease_ttl_s + 1.5)  # the lease expires, sessions are rebound
        say("next turns fail over to the survivor and restore from the daemons")
        for session, history in histories.items():
            _turn(http, cluster.router_url, session, history, "And after the failure?", 16,
                  log)
        if log.killed is not None and restart_killed:
            say(f"restarting {log.killed}")
            cluster.restart_worker(log.killed)
            log.note(f"{log.killed} back")
        for session, history in histories.items():
            _turn(http, cluster.router_url, session, history, "One last note, please.", 16,
                  log)
    time.sleep(3)  # a few more scrapes after the last request
    log.ended = time.time()
    return log
