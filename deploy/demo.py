"""`kvkeep demo`: a worker dies in the middle of a streamed answer, and nobody notices.

On a real local cluster (etcd, 2 kvstore daemons, 2 vLLM workers with the kvkeep connector,
their agents, 1 router), with a tiny random-weight model and greedy decoding:

1. Alice has a multi-turn conversation through the router with the `openai` client, streaming.
   Bob, a second session, lives on the same worker (the router sends him there because his
   prompt shares Alice's system prompt, whose KV that worker holds).
2. While Alice's second answer streams, her worker is SIGKILLed (vLLM and its agent: the node
   is gone). The router resumes the stream on the other worker from the tokens already sent;
   the client just keeps reading. Its text is compared with a reference computed without any
   failure.
3. The dead worker's lease expires; the router rebinds Bob. His next turn goes to the survivor
   with a restore hint, and the survivor loads his KV from the kvstore daemons instead of
   recomputing it. Alice's next turn lands on the survivor as well.

Every claim is a named check; the numbers come from the router's headers and SSE notes, vLLM's
`/metrics` and the daemons' Stat (see `deploy/observe.py`). Exit status 0 only if all pass.
"""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from deploy.conversation import ChatSession, Turn, reference_answer
from deploy.local.cluster import ClusterSpec, LocalCluster
from deploy.local.probes import http_json
from deploy.observe import EngineCache, StoreTraffic, scrape_engine, scrape_stores
from deploy.report import Report
from kvstore.errors import ConfigError, KVKeepError

__all__ = ["DemoOptions", "SYSTEM_PROMPT", "demo_cluster", "run_demo", "run_scenario"]

# The tokenizer was trained on licence texts, so licence prose tokenizes compactly; the model's
# weights are random, so its answers are word salad: what matters is that tokens are exact.
SYSTEM_PROMPT = (
    "You are a careful assistant. Permission is hereby granted, free of charge, to any person "
    "obtaining a copy of this software and associated documentation files, to deal in the "
    "Software without restriction, including without limitation the rights to use, copy, "
    "modify, merge, publish, distribute, sublicense, and/or sell copies of the Software.")
ALICE = (
    "Explain when the above copyright notice and this permission notice shall be included in "
    "all copies or substantial portions of the Software.",
    "THE SOFTWARE IS PROVIDED AS IS, WITHOUT WARRANTY OF ANY KIND. Tell a long story about it.",
    "Now summarise what you said.",
)
BOB_OPENERS = (
    "What does the license say about distributing modified versions of the Program?",
    "Who may copy, modify, merge, publish and distribute copies of the Software?",
    "Explain the conditions of the warranty disclaimer in plain words.",
    "Describe the terms for conveying object code in source form.",
)
BOB = (
    "Must the copyright notice be included in all copies or substantial portions?",
    "And what about patents?",
)


@dataclass(frozen=True, slots=True)
class DemoOptions:
    first_tokens: int = 48
    stream_tokens: int = 320
    """Length of the answer during which the worker dies: long enough that the kill lands
    mid-stream even though the tiny model decodes hundreds of tokens a second."""
    kill_after_chunks: int = 40
    """Chunks the client has read when the kill comes: past one KV block of decode, so a
    decode-time checkpoint is among what the survivor restores."""
    later_tokens: int = 32
    bob_attempts: int = 6
    lease_ttl_s: float = 2.0
    json_path: Path | None = None
    model_dir: Path | None = None
    base_dir: Path | None = None
    keep_dir: bool = False
    tls: bool = False
    """The cluster with deploy/k8s's trust settings (ClusterSpec.tls)."""

    def __post_init__(self) -> None:
        if not 0 < self.kill_after_chunks < self.stream_tokens:
            raise ConfigError("the kill must come mid-stream: 0 < kill_after_chunks < "
                              f"stream_tokens, got {self.kill_after_chunks} and "
                              f"{self.stream_tokens}")


def demo_cluster(options: DemoOptions) -> LocalCluster:
    """The demo's cluster, not yet started (`run_demo` starts it; tests start it themselves to
    watch it with Prometheus while the scenario runs)."""
    return LocalCluster(ClusterSpec(
        daemons=2, workers=2, routers=1, lease_ttl_s=options.lease_ttl_s,
        model_dir=options.model_dir, base_dir=options.base_dir, keep_dir=options.keep_dir,
        tls=options.tls))


def run_scenario(cluster: LocalCluster, options: DemoOptions, report: Report) -> None:
    """The demo's story on a started `demo_cluster`: its checks and numbers go into `report`
    (`killed_worker` among the numbers once the kill has struck)."""
    _Scenario(cluster, options, report).run()


def run_demo(options: DemoOptions, out: TextIO = sys.stdout) -> Report:
    """Run the whole demo; the report says what passed (and is written to `json_path`)."""
    report = Report("kvkeep failover demo", out=out)
    cluster = demo_cluster(options)
    try:
        report.step("start a local cluster: etcd, 2 kvstore daemons, 2 vLLM workers with the "
                    "kvkeep connector (host RAM + the daemons via etcd), 2 agents, 1 router")
        cluster.start(report.say)
        report.record(cluster_start_s=round(time.monotonic() - report.started, 1))
        report.say(f"logs in {cluster.logs}" + ("" if options.keep_dir else
                                                 " (removed at the end; --keep to keep)"))
        run_scenario(cluster, options, report)
    except Exception as exc:  # every failure is reported as one, and the cluster still stops
        report.check("demo ran to completion", False,
                     f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
        report.say(str(exc))
    finally:
        report.step("stop every process (reverse order, SIGTERM then SIGKILL) and clean up")
        cluster.stop()
        report.summary()
        if options.json_path is not None:
            report.write_json(options.json_path)
            print(f"summary written to {options.json_path}", file=out)
    return report


class _Scenario:
    def __init__(self, cluster: LocalCluster, options: DemoOptions, report: Report) -> None:
        self.cluster = cluster
        self.options = options
        self.report = report
        self.router = cluster.router_url
        self.alice = ChatSession(self.router, "alice", system=SYSTEM_PROMPT)
        self.bob: ChatSession | None = None
        self.home = ""
        self.survivor = ""
        self.killed_at: float | None = None
        self._gone_watch: threading.Thread | None = None
        self._gone_at: float | None = None
        # The survivor's engine counters from before the kill: the failover's prefetch can
        # land, and be published by a step of the resumed stream, before Bob's turn begins.
        self._survivor_before_kill: EngineCache | None = None

    def run(self) -> None:
        try:
            self._first_turns()
            self._kill_mid_stream()
            self._lease_expires()
            self._bob_fails_over()
            self._alice_continues()
        finally:
            self.alice.close()
            if self.bob is not None:
                self.bob.close()

    # --- steps -----------------------------------------------------------------------------
    def _first_turns(self) -> None:
        r, o = self.report, self.options
        r.step("Alice's first turn, streamed through the router with the openai client")
        turn = self.alice.ask(ALICE[0], o.first_tokens)
        self._show(turn)
        if not r.check("first turn", turn.error is None and turn.worker is not None,
                       turn.error or f"served by {turn.worker} ({turn.route})"):
            raise KVKeepError("the first turn failed; nothing to fail over")
        self.home = str(turn.worker)
        self.survivor = next(w for w in self.cluster.workers if w != self.home)

        r.step(f"Bob opens a session; the router's prefix scorer favours {self.home}, which "
               "holds the shared system prompt's KV (load scorers may still send him away)")
        for attempt in range(o.bob_attempts):
            # The router charges each pick to its worker until the next /metrics scrape
            # (every 0.5 s): a request sent right after Alice's would find her worker looking
            # busy. A user arriving a second later does not.
            time.sleep(1.0)
            # Each try opens with another question: a repeated prompt would be drawn to the
            # worker that served the previous try, whose cache holds exactly that prompt.
            bob = ChatSession(self.router, "bob" if attempt == 0 else f"bob-{attempt + 1}",
                              system=SYSTEM_PROMPT)
            turn = bob.ask(BOB_OPENERS[attempt % len(BOB_OPENERS)], o.first_tokens)
            r.say(f"session {bob.session_id}: worker {turn.worker} ({turn.route}), "
                  f"{turn.cached_tokens} of {turn.prompt_tokens} prompt tokens cached")
            if turn.error is None and turn.worker == self.home:
                self.bob = bob
                break
            bob.close()  # it stays bound elsewhere; harmless, and not part of the story
        chosen = self.bob
        if not r.check("second session on the same worker", chosen is not None,
                       f"{chosen.session_id} on {self.home}" if chosen else
                       f"no new session landed on {self.home} in {o.bob_attempts} tries"):
            return
        assert chosen is not None
        # A second turn: the templated prompt of a later turn then starts with blocks the
        # store holds (an answer re-tokenized from its text rarely matches the generated ids,
        # so a conversation's earlier prompts are what a next turn can restore).
        turn = chosen.ask(BOB[0], o.later_tokens)
        r.say(f"{chosen.session_id}'s second turn: worker {turn.worker} ({turn.route}), "
              f"{turn.cached_tokens} of {turn.prompt_tokens} prompt tokens cached")

    def _kill_mid_stream(self) -> None:
        r, o = self.report, self.options
        r.step(f"Alice's second turn streams from {self.home}; after {o.kill_after_chunks} "
               f"chunks {self.home} is SIGKILLed (vLLM and its agent)")
        messages = self.alice.messages_for(ALICE[1])
        reference = reference_answer(self.router, messages, o.stream_tokens)
        r.say(f"reference answer computed first: one unbroken non-streamed request of "
              f"{o.stream_tokens} tokens, salted so that it shares no KV with the session")
        engine_before, store_before = self._counters(self.survivor)
        self._survivor_before_kill = engine_before

        def kill_midway(chunks: int) -> None:
            if chunks >= o.kill_after_chunks and self.killed_at is None:
                self.killed_at = self.cluster.kill_worker(self.home)
                r.record(killed_worker=self.home)
                self._watch_for_gone()
                r.say(f"*** SIGKILL {self.home} after the client read {chunks} chunks ***")

        turn = self.alice.ask(ALICE[1], o.stream_tokens, on_chunk=kill_midway)
        engine_after, store_after = self._counters(self.survivor)
        self._show(turn)
        resumed = turn.resumptions
        r.check("the kill landed mid-stream", self.killed_at is not None and bool(resumed),
                f"router resumed on {resumed[0]['resumed_on']} after "
                f"{resumed[0]['after_tokens']} tokens" if resumed else
                "the stream ended before the kill (raise --stream-tokens)")
        r.check("the client did not notice", turn.error is None
                and turn.completion_tokens == o.stream_tokens,
                turn.error or f"one unbroken stream, {turn.chunks} chunks, "
                f"{turn.completion_tokens} tokens, no error")
        r.check("same text as without the failure", turn.text == reference,
                "identical to the reference" if turn.text == reference else
                f"differs from the reference at char {_first_diff(turn.text, reference)}")
        restored = self._restored(engine_before, engine_after, store_before, store_after,
                                  "resumed stream")
        r.record(kill_after_chunks=o.kill_after_chunks,
                 resumed_after_tokens=resumed[0]["after_tokens"] if resumed else None,
                 resumed_on=resumed[0]["resumed_on"] if resumed else None,
                 stream_tokens=turn.completion_tokens, stream_restored_tokens=restored)

    def _lease_expires(self) -> None:
        r, o = self.report, self.options
        r.step(f"{self.home}'s lease expires; the router drops it and rebinds its sessions")
        start = time.monotonic()
        if self._gone_watch is not None:
            self._gone_watch.join(timeout=30)
        else:  # no kill happened (the stream was too short): watch from now
            self._watch_until_gone(30)
        gone = self._gone_at is not None
        seconds = (self._gone_at or time.monotonic()) - (self.killed_at or start)
        r.record(worker_gone_after_s=round(seconds, 2), lease_ttl_s=o.lease_ttl_s)
        r.check("dead worker detected", gone and seconds <= o.lease_ttl_s + 1.5,
                f"{self.home} gone from the router {seconds:.1f}s after the kill "
                f"(lease TTL {o.lease_ttl_s:.0f}s)")
        if self.bob is not None:
            binding = self._binding(self.bob.session_id)
            r.say(f"{self.bob.session_id}'s binding now: {binding}")

    def _bob_fails_over(self) -> None:
        r, o = self.report, self.options
        if self.bob is None:
            r.check("failover of an idle session", False, "no second session to fail over")
            return
        r.step(f"{self.bob.session_id}'s next turn, a moment later: to {self.survivor} with a "
               "restore hint; his KV was prefetched from the kvstore daemons into its RAM "
               "when the router rebound him")
        # The hint is written when the lease expires, while Alice's resumed stream may still be
        # running on the survivor: the prefetch's reads and the step that publishes its counter
        # can come before this turn, or (with the reference answer's or this turn's steps)
        # after. Counting from before the kill catches every case.
        early = self._survivor_before_kill
        reference = reference_answer(self.router, self.bob.messages_for(BOB[1]),
                                     o.later_tokens)
        engine_before, store_before = self._counters(self.survivor)
        turn = self.bob.ask(BOB[1], o.later_tokens)
        engine_after, store_after = self._counters(self.survivor)
        prefetched = 0 if early is None or engine_after is None else int(
            (engine_after - early).prefetched_blocks)
        self._show(turn)
        r.check("lands on the survivor with a restore hint",
                turn.worker == self.survivor and turn.route == "failover" and turn.restore_hint,
                f"worker {turn.worker}, route {turn.route}, restore hint "
                f"{'sent' if turn.restore_hint else 'absent'}")
        r.check("same text as without the failure (Bob)", turn.error is None
                and turn.text == reference, turn.error or (
                    "identical to the reference" if turn.text == reference else "differs"))
        restored = self._restored(engine_before, engine_after, store_before, store_after,
                                  "Bob's turn", prefetched=prefetched)
        r.check("Bob's KV prefetched into the survivor's RAM at the failover", prefetched > 0,
                f"{prefetched} blocks pulled from the daemons on the router's hint")
        r.record(bob_prompt_tokens=turn.prompt_tokens, bob_cached_tokens=turn.cached_tokens,
                 bob_restored_tokens=restored, bob_prefetched_blocks=prefetched)

    def _alice_continues(self) -> None:
        r, o = self.report, self.options
        r.step("Alice's third turn: she simply goes on")
        reference = reference_answer(self.router, self.alice.messages_for(ALICE[2]),
                                     o.later_tokens)
        turn = self.alice.ask(ALICE[2], o.later_tokens)
        self._show(turn)
        r.check("next turn on the survivor", turn.worker == self.survivor,
                f"worker {turn.worker} ({turn.route}); {turn.cached_tokens} of "
                f"{turn.prompt_tokens} prompt tokens cached there")
        r.check("same text as without the failure (Alice, later turn)",
                turn.error is None and turn.text == reference,
                turn.error or ("identical to the reference" if turn.text == reference
                               else "differs"))
        r.record(alice_turn3_prompt_tokens=turn.prompt_tokens,
                 alice_turn3_cached_tokens=turn.cached_tokens)

    # --- helpers ---------------------------------------------------------------------------
    def _counters(self, worker_id: str) -> tuple[EngineCache | None, StoreTraffic]:
        daemons = [(d.node_id, d.address) for d in self.cluster.daemons]
        return (scrape_engine(self.cluster.workers[worker_id].url), scrape_stores(
            daemons, tls=self.cluster.daemon_tls))

    def _restored(self, e0: EngineCache | None, e1: EngineCache | None, s0: StoreTraffic,
                  s1: StoreTraffic, what: str, *, prefetched: int = 0) -> int:
        """Report where the prompt's KV came from; returns the tokens the connector loaded.
        `prefetched`: blocks that left the daemons before `s0`, pulled into the worker's RAM
        on the failover hint (the loads are then from RAM)."""
        if e0 is None or e1 is None:
            self.report.check(f"KV restored from the store ({what})", False,
                              f"cannot read {self.survivor}'s /metrics")
            return 0
        d, s = e1 - e0, s1 - s0
        restored = int(d.external_hits)
        recomputed = int(d.queries - d.local_hits - d.external_hits)
        self.report.say(
            f"{self.survivor} /metrics: {int(d.queries)} prompt tokens; {int(d.local_hits)} "
            f"from its own prefix cache, {restored} loaded by the kvkeep connector, "
            f"{recomputed} computed")
        stats_ok = s1.reachable == len(self.cluster.daemons) == s0.reachable
        if stats_ok:
            self.report.say(f"kvstore daemons: {s.hits} reads served ({s.get_bytes} bytes) "
                            f"to {self.survivor}")
        else:
            self.report.say("kvstore daemons: Stat unavailable, block reads not counted")
        if prefetched:
            self.report.say(f"{self.survivor}'s connector: {prefetched} blocks prefetched into "
                            "its RAM on the router's failover hint")
        self.report.check(f"KV restored from the store ({what})",
                          restored > 0 and (s.hits > 0 or prefetched > 0 or not stats_ok),
                          f"{restored} tokens loaded by the connector"
                          + (f", {s.hits} reads from the daemons" if stats_ok else "")
                          if restored > 0 else
                          "the connector loaded nothing: the prompt was recomputed")
        return restored

    def _watch_for_gone(self) -> None:
        """From the kill on, note when the router stops listing the killed worker: the stream
        goes on meanwhile, so the check must not be timed by when it gets to look."""
        self._gone_watch = threading.Thread(target=self._watch_until_gone, args=(30,),
                                             name="demo-gone-watch", daemon=True)
        self._gone_watch.start()

    def _watch_until_gone(self, limit_s: float) -> None:
        start = time.monotonic()
        while time.monotonic() - start < limit_s:
            listed = self._registered()
            if listed is not None and self.home not in listed:  # None: no answer, ask again
                self._gone_at = time.monotonic()
                return
            time.sleep(0.05)

    def _registered(self) -> set[str] | None:
        """The workers the router lists; None if it did not answer."""
        listed = http_json(f"{self.router}/kvkeep/workers")
        return {str(w["id"]) for w in listed} if isinstance(listed, list) else None

    def _binding(self, session_id: str) -> str:
        b = http_json(f"{self.router}/kvkeep/sessions/{session_id}")
        if not isinstance(b, dict):
            return "unknown"
        return (f"worker {b.get('worker')}, reason {b.get('reason')}, restore from "
                f"{b.get('restore_from')}")

    def _show(self, turn: Turn) -> None:
        words = turn.text.split()
        preview = " ".join(words[:12]) + (" ..." if len(words) > 12 else "")
        self.report.say(f"{turn.worker} ({turn.route}), {turn.completion_tokens} tokens in "
                        f"{turn.seconds:.1f}s, cached prompt tokens {turn.cached_tokens}: "
                        f"{preview!r}")
        for note in turn.notes:
            self.report.say(f"router SSE note: {note}")


def _first_diff(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                min(len(a), len(b)))
