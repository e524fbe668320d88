"""`kvkeep chaos --kubectl`: rounds of concurrent streamed turns against a deployed cluster
(deploy/k8s), a random worker pod deleted during each round but the last, and recovered before
the next; then the verdict. (A local cluster runs scenarios instead: `scenario_runner`,
`--kills N` included.)

Bounded on purpose: `sessions x (kills + 1)` turns of `max_tokens` each, and no new round after
`deadline_s`. Passing means: every answer equals its reference (no token lost, doubled or
changed), no turn failed, every session still has a binding on a live worker at the end, and
the kills really hit live streams (otherwise the run proved nothing).
"""

from __future__ import annotations

import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from deploy.chaos.killers import Killer, KubectlKiller, usable_workers
from deploy.chaos.load import (
    InFlight,
    RoundResult,
    RoundsSessionScript,
    compute_references,
    open_sessions,
    run_round,
    scripts,
)
from deploy.local.probes import http_json, wait_until
from deploy.report import Report
from kvstore.errors import ConfigError, KVKeepError

__all__ = ["ChaosOptions", "run_kubectl_chaos"]


@dataclass(frozen=True, slots=True)
class ChaosOptions:
    kills: int = 2
    sessions: int = 6
    max_tokens: int = 96
    seed: int = 0
    deadline_s: float = 300.0
    kill_after_chunks: int = 8
    """The killer strikes once some stream of the round has sent this many chunks."""
    json_path: Path | None = None
    keep_dir: bool = False
    model_dir: Path | None = None
    workers: int = 2
    model: str | None = None

    def __post_init__(self) -> None:
        if self.kills < 0 or self.sessions < 1 or self.max_tokens <= self.kill_after_chunks:
            raise ConfigError("chaos: kills >= 0, sessions >= 1, and max_tokens above "
                              f"{self.kill_after_chunks} (the kill comes mid-answer)")


def run_kubectl_chaos(options: ChaosOptions, *, router_url: str, namespace: str,
                      selector: str, out: TextIO = sys.stdout) -> Report:
    """Chaos against a deployment of deploy/k8s: worker pods deleted with kubectl."""
    report = Report("kvkeep chaos (kubectl)", out=out)
    try:
        report.step(f"find worker pods ({selector}) in namespace {namespace}")
        killer = KubectlKiller(namespace, selector, router_url.rstrip("/"))
        report.say(f"targets: {', '.join(killer.targets())}")
        model = options.model or _first_model(router_url)
        _chaos(killer, router_url.rstrip("/"), model, options, report)
    except Exception as exc:  # reported as a failed check, like every other failure
        report.check("chaos ran to completion", False, _first_line(exc))
    finally:
        _finish(report, options, out)
    return report


def _chaos(killer: Killer, router_url: str, model: str, options: ChaosOptions,
           report: Report) -> None:
    rng = random.Random(options.seed)
    rounds = options.kills + 1
    plan = scripts(options.sessions, rounds, options.seed)
    report.step(f"references: {options.sessions} sessions x {rounds} turns, computed before "
                "any failure (unbroken requests, salted: they share no KV with the sessions)")
    references = compute_references(router_url, model, plan, options.max_tokens)
    sessions = open_sessions(router_url, model, plan)
    deadline = report.started + options.deadline_s
    results: list[RoundResult] = []
    kills: list[dict[str, object]] = []
    try:
        for index in range(rounds):
            if time.monotonic() > deadline:
                report.check("bounded in time", False,
                             f"deadline of {options.deadline_s:.0f}s reached before round "
                             f"{index + 1}")
                break
            strike = index < options.kills
            report.step(f"round {index + 1}/{rounds}: {len(plan)} sessions stream a turn at "
                        "once" + ("; a random busy worker is SIGKILLed mid-stream" if strike
                                  else "; no kill (after the last recovery)"))
            in_flight = InFlight()
            victims: list[str] = []

            def kill_one(flight: InFlight = in_flight, hit: list[str] = victims) -> None:
                victim = _strike(killer, flight, rng, options.kill_after_chunks)
                if victim is not None:
                    hit.append(victim)
                    report.say(f"*** killed {victim} ({flight.live()} streams live) ***")

            result = run_round(index, sessions, plan, references, options.max_tokens,
                               in_flight, kill_one if strike else None)
            results.append(result)
            _describe(result, report)
            bad = result.mismatched
            report.check(f"round {index + 1}: every answer equals its reference", not bad,
                         f"{len(result.turns)} answers identical, {result.resumed} of them "
                         "resumed on another worker mid-stream" if not bad else
                         f"{len(bad)} differ or failed: {', '.join(bad)}")
            for victim in victims:
                started = time.monotonic()
                killer.recover(victim)
                report.say(f"{victim} serving again after {time.monotonic() - started:.0f}s")
                kills.append({"round": index + 1, "worker": victim,
                              "resumed_streams": result.resumed})
    finally:
        for session in sessions.values():
            session.close()
    _verdict(router_url, plan, results, kills, options, report)


def _strike(killer: Killer, in_flight: InFlight, rng: random.Random,
            after_chunks: int) -> str | None:
    """Wait until a stream is under way, then kill a random worker among those streaming."""
    wait_until(lambda: in_flight.most_chunks() >= after_chunks
               or (in_flight.started.is_set() and in_flight.live() == 0),
               timeout=120, what="the round's streams to start", step=0.01)
    targets = killer.targets()
    if in_flight.live() == 0 or len(targets) < 2:
        return None  # the round is over, or only one worker is left: never kill the last
    busy = sorted(in_flight.busy_workers() & set(targets))
    victim = rng.choice(busy or targets)
    killer.kill(victim)
    return victim


def _describe(result: RoundResult, report: Report) -> None:
    for sid, turn in sorted(result.turns.items()):
        moved = "; ".join(f"resumed on {n['resumed_on']} after {n['after_tokens']} tokens"
                          for n in turn.resumptions)
        report.say(f"{sid}: {turn.worker} ({turn.route}) {turn.completion_tokens} tokens"
                   + (f"; {moved}" if moved else "") + (f"; ERROR {turn.error}"
                                                         if turn.error else ""))


def _verdict(router_url: str, plan: list[RoundsSessionScript], results: list[RoundResult],
             kills: list[dict[str, object]], options: ChaosOptions, report: Report) -> None:
    report.step("verdict")
    rounds_done = len(results)
    resumed = sum(r.resumed for r in results)
    answers = sum(len(r.turns) for r in results)
    wrong = sum(len(r.mismatched) for r in results)
    report.check("kills hit live streams", len(kills) == options.kills and
                 (options.kills == 0 or resumed > 0),
                 f"{len(kills)} of {options.kills} kills done, {resumed} streams resumed")
    alive = usable_workers(router_url)
    lost = []
    for script in plan:
        sid = script.session_id
        binding = http_json(f"{router_url}/kvkeep/sessions/{sid}")
        turns_ok = all(sid in r.turns and r.turns[sid].error is None for r in results)
        if not (turns_ok and isinstance(binding, dict) and binding.get("worker") in alive):
            lost.append(sid)
    report.check("no session lost", not lost and rounds_done == options.kills + 1,
                 f"all {len(plan)} sessions answered every turn and are bound to a live "
                 "worker" if not lost else f"lost: {', '.join(lost)}")
    report.record(kills=kills, rounds=rounds_done, answers=answers, wrong_answers=wrong,
                  resumed_streams=resumed, sessions=len(plan), max_tokens=options.max_tokens,
                  seed=options.seed)


def _finish(report: Report, options: ChaosOptions, out: TextIO) -> None:
    report.summary()
    if options.json_path is not None:
        report.write_json(options.json_path)
        print(f"summary written to {options.json_path}", file=out)


def _first_line(exc: Exception) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def _first_model(router_url: str) -> str:
    listed = http_json(f"{router_url.rstrip('/')}/v1/models")
    try:
        return str(listed["data"][0]["id"])
    except (TypeError, KeyError, IndexError) as exc:
        raise KVKeepError(f"no model listed by {router_url}/v1/models") from exc
