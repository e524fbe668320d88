"""The chaos suite's parts that need no cluster: scenario files, counting, the router pool, the
report's arithmetic. (The parts that touch real processes: test_chaos_parts.py; whole
scenarios through the CLI: test_deploy_chaos_*.py.)"""

from __future__ import annotations

import itertools
import random
import time
from pathlib import Path

import pytest

from deploy.chaos.client import Resumption, Retry, RouterPool, TurnRecord, _Done, _resumptions
from deploy.chaos.counters import CounterTally
from deploy.chaos.faults import FaultRecord
from deploy.chaos.registrations import Departure
from deploy.chaos.scenario import (
    KILL_SPACING_S,
    SCENARIO_DIR,
    KillDaemon,
    KillWorker,
    Partition,
    PauseEtcd,
    kills_scenario,
    load_scenario,
)
from deploy.chaos.storage import ProbeResult
from deploy.chaos.summary import RunFacts, summarize
from deploy.chaos.traffic import Streams, make_scripts
from kvstore.errors import ConfigError

SHIPPED = sorted(SCENARIO_DIR.glob("*.yaml"))


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "s.yaml"
    path.write_text(text)
    return path


_LOAD = "load: {sessions: 2, turns: 3, duration_s: 30, concurrency: 2}\n"


def test_every_shipped_scenario_parses() -> None:
    assert len(SHIPPED) >= 3
    for path in SHIPPED:
        scenario = load_scenario(path)
        assert scenario.faults, path
        assert scenario.end_of_faults_s < scenario.load.duration_s


def test_the_ci_scenario_kills_a_worker_a_daemon_and_pauses_etcd() -> None:
    ci = [load_scenario(p) for p in SHIPPED if "ci" in load_scenario(p).name]
    assert len(ci) == 1
    kinds = {type(f) for f in ci[0].faults}
    assert {KillWorker, KillDaemon, PauseEtcd} <= kinds


def test_every_fault_holds_every_fault_of_the_ci_scenario() -> None:
    """`make test` runs every-fault.yaml instead of ci.yaml where it can (root), so every fault
    the ci scenario strikes, with its kind of target and the way it ends (restarted or not),
    must be struck by every-fault too."""
    def shapes(name: str) -> set[tuple[type, str, bool]]:
        faults = load_scenario(SCENARIO_DIR / name).faults
        return {(type(f), str(getattr(f, "target", "")).rstrip("0123456789"),
                 getattr(f, "restart_after", None) is not None) for f in faults}

    every, ci = shapes("every-fault.yaml"), shapes("ci.yaml")
    missing = {(kind, target, restarted) for kind, target, restarted in ci
               if not any(k is kind and restarted <= r for k, _t, r in every)}
    assert not missing, missing
    assert {KillWorker, KillDaemon, PauseEtcd} <= {kind for kind, _t, _r in every}


@pytest.mark.parametrize(("kills", "sessions", "max_tokens"), [(2, 4, 64), (0, 1, 16), (3, 6, 96)])
def test_kills_flags_are_a_scenario_of_busy_worker_kills(kills: int, sessions: int,
                                                         max_tokens: int) -> None:
    """`kvkeep chaos --kills N` runs through the scenario runner: N mid-answer kills of a busy
    worker, each restarted, spaced so the previous one serves again, all inside the load."""
    s = kills_scenario(kills=kills, sessions=sessions, max_tokens=max_tokens, seed=5,
                       workers=3)
    assert [type(f) for f in s.faults] == [KillWorker] * kills
    assert all(isinstance(f, KillWorker) and f.target == "busy" and f.restart_after == 0
               and f.mid_stream_left < max_tokens for f in s.faults)
    times = [f.at for f in s.faults]
    assert all(b - a >= KILL_SPACING_S for a, b in itertools.pairwise(times))
    assert s.end_of_faults_s < s.load.duration_s and s.load.turns >= kills + 1
    assert (s.load.sessions, s.load.max_tokens, s.seed, s.cluster.workers) == (
        sessions, (max_tokens, max_tokens), 5, 3)
    for bad in ({"kills": -1}, {"sessions": 0}, {"max_tokens": 8}):
        args = {"kills": kills, "sessions": sessions, "max_tokens": max_tokens, **bad}
        with pytest.raises(ConfigError):
            kills_scenario(seed=0, **args)


def test_the_long_scenario_is_fifty_sessions_and_a_fault_every_twenty_seconds() -> None:
    long = load_scenario(SCENARIO_DIR / "long.yaml")
    assert long.load.sessions >= 50 and long.load.duration_s >= 300
    times = sorted(f.at for f in long.faults)
    assert len(times) >= 14 and max(b - a for a, b in itertools.pairwise(times)) <= 20


@pytest.mark.parametrize(("text", "complaint"), [
    ("name: x\nload: {sessions: 2, turns: 3, duration_s: 30, concurrency: 2, speed: 9}\n",
     "unknown field `speed`"),
    ("name: x\n" + _LOAD + "faults: [{kind: explode, at: 1}]\n", "'explode'"),
    ("name: x\n" + _LOAD + "faults: [{kind: kill_daemon, at: 1, target: d7}]\n",
     "target 'd7'"),
    ("name: x\n" + _LOAD + "faults: [{kind: kill_worker, at: 40}]\n", "after the load"),
    ("name: x\n" + _LOAD + "faults: [{kind: fill_disk, at: 1}]\n", "daemon_disk_tmpfs"),
    ("name: x\n" + _LOAD + "faults: [{kind: partition, at: 1, target: w1, from: routers}]\n",
     "$.faults[0].from"),
    ("name: x\ncluster: {daemons: 1, replicas: 2}\n" + _LOAD, "replicas 2 > daemons 1"),
    ("name: x\nload: {sessions: 2, turns: 3, duration_s: 30, concurrency: 2, "
     "max_tokens: [90, 10]}\n", "max_tokens [90, 10]"),
    ("name: [unclosed\n", "not YAML"),
])
def test_bad_scenarios_are_refused_naming_what_is_wrong(tmp_path: Path, text: str,
                                                        complaint: str) -> None:
    with pytest.raises(ConfigError, match="chaos scenario") as err:
        load_scenario(_write(tmp_path, text))
    assert complaint in str(err.value)


def test_partition_targets_are_the_isolated_workers(tmp_path: Path) -> None:
    s = load_scenario(_write(tmp_path, "name: x\ncluster: {workers: 3}\n" + _LOAD + (
        "faults:\n  - {kind: partition, at: 1, target: w3, from: etcd}\n"
        "  - {kind: partition, at: 2, target: w3, from: daemons, duration: 2}\n"
        "  - {kind: partition, at: 3, target: w1, from: etcd}\n")))
    assert s.isolated_workers == ("w1", "w3")
    assert [f.from_ for f in s.faults if isinstance(f, Partition)] == ["etcd", "daemons", "etcd"]


def test_scripts_share_prefixes_and_follow_the_seed() -> None:
    s = load_scenario(SCENARIO_DIR / "ci.yaml")
    one, again = make_scripts(s.load, 3, "t"), make_scripts(s.load, 3, "t")
    other = make_scripts(s.load, 4, "t")
    assert one == again and one != other
    assert len({x.system for x in one}) == s.load.shared_prefixes
    assert all(len(x.questions) == s.load.turns for x in one)
    low, high = s.load.max_tokens
    assert all(low <= m <= high for x in one for m in x.max_tokens)


def test_tally_sums_increases_across_restarts() -> None:
    tally = CounterTally()
    tally.observe("w1", {"restored_tokens": 100})   # the baseline: not counted
    tally.observe("w1", {"restored_tokens": 160})
    tally.observe("w1", {"restored_tokens": 30})    # restarted: counts from zero again
    tally.observe("w2", {"restored_tokens": 5})
    tally.observe("w2", {"restored_tokens": 9})
    assert tally.total("restored_tokens") == 60 + 30 + 4
    assert tally.by_source("restored_tokens") == {"w1": 90, "w2": 4}


def test_router_pool_puts_replicas_seen_down_last() -> None:
    pool = RouterPool(["http://a", "http://b", "http://c"], down_for_s=0.2)
    rng = random.Random(0)
    pool.mark_down("http://b")
    for _ in range(5):
        order = pool.order(rng)
        assert sorted(order) == ["http://a", "http://b", "http://c"] and order[-1] == "http://b"
    time.sleep(0.25)
    assert {pool.order(rng)[0] for _ in range(40)} == {"http://a", "http://b", "http://c"}


def test_streams_name_workers_with_a_stream_far_from_its_end() -> None:
    streams = Streams()
    streams.progress("s1", 64, "w1", 10)   # 54 to go
    streams.progress("s2", 64, "w2", 60)   # 4 to go
    streams.progress("s3", 64, None, 30)   # headers not in yet
    assert streams.busy(8, min_left=16) == {"w1": 54}
    assert streams.busy(8) == {"w1": 54, "w2": 4}
    streams.done("s1")
    assert streams.busy(8, min_left=16) == {} and streams.count() == 2


def test_a_resumption_is_timed_across_the_break() -> None:
    done = _Done(token_times=[1.0, 1.1, 1.2, 2.5, 2.6],
                 notes=[(2.4, {"resumed_on": "w2", "after_tokens": 3}),
                        (2.7, {"worker": "w2", "completion_tokens": 5})])
    assert list(_resumptions(done)) == [Resumption("w2", 3, pytest.approx(1.3))]


def _turn(sid: str, index: int, text: str, **kw: object) -> TurnRecord:
    base: dict[str, object] = dict(
        session_id=sid, index=index, text=text, error=None, started_s=0.0, seconds=1.0,
        ttft_s=0.1, router="http://r1", worker="w1", route="sticky", restore_hint=False,
        prompt_tokens=100, cached_tokens=64, completion_tokens=8)
    base.update(kw)
    return TurnRecord(**base)  # type: ignore[arg-type]


def test_summary_counts_each_target_from_what_happened(tmp_path: Path) -> None:
    s = load_scenario(_write(tmp_path, "name: x\n" + _LOAD))
    scripts = make_scripts(s.load, 0, "t")
    refs = {x.session_id: ["a", "b", "c"] for x in scripts}
    s0, s1 = (x.session_id for x in scripts)
    records = [
        _turn(s0, 0, "a"), _turn(s0, 1, "b", resumptions=(Resumption("w2", 3, 0.4),)),
        _turn(s0, 2, "WRONG", restore_hint=True, route="failover", ttft_s=0.3),
        _turn(s1, 0, "a", retries=(Retry("http://r1", "ReadError", 0.2),)),
        _turn(s1, 1, "", error="APIError: no healthy worker"),
    ]
    faults = [FaultRecord("kill_worker", 5.0, started_s=5.0, ended_s=50.0, target="w1",
                          detect_s=0.5),
              FaultRecord("partition", 9.0, started_s=9.0, ended_s=20.0, target="w2",
                          detect_s=2.5)]
    departures = [Departure("worker", "w1", 105.6, None),      # the kill at 5 s: explained
                  Departure("worker", "w2", 130.0, 130.02)]    # nothing touched it then
    out = summarize(RunFacts(scripts, refs, records, faults, CounterTally(), CounterTally(),
                             ProbeResult(probes=4, misses=3, served_corrupt=1), [], 40.0,
                             departures, t0=100.0))
    assert out["turns"] == 6 and out["turns_done"] == 4
    assert out["client_errors"] == 1 and out["lost_sessions"] == 1
    assert out["lost_session_ids"] == [s1]
    assert out["outputs_differing_from_reference"] == 1
    assert out["corrupt_reads_served"] == 1 + 1   # the probe's, and the restored wrong answer
    assert out["failover_detect_s"] == {"p50": 1.5, "max": 2.5}
    assert out["resume_ttft_s"]["p50"] == pytest.approx(0.3)
    assert out["failover_turn_ttft_s"]["p50"] == pytest.approx(0.3)
    assert out["resumed_streams"] == 1 and out["retried_turns"] == 1
    assert [d["explained_by"] for d in out["registrations_lost"]] == ["kill_worker@5", None]
    assert out["unexplained_registration_losses"] == 1


def test_a_session_whose_turns_never_ran_is_lost(tmp_path: Path) -> None:
    s = load_scenario(_write(tmp_path, "name: x\n" + _LOAD))
    scripts = make_scripts(s.load, 0, "t")
    refs = {x.session_id: ["a", "b", "c"] for x in scripts}
    records = [_turn(x.session_id, k, "abc"[k]) for x in scripts for k in range(3)][:-1]
    out = summarize(RunFacts(scripts, refs, records, [], CounterTally(), CounterTally(),
                             ProbeResult(), [scripts[0].session_id], 30.0, [], 0.0))
    assert out["client_errors"] == 0 and out["outputs_differing_from_reference"] == 0
    assert out["lost_session_ids"] == sorted(x.session_id for x in scripts)

