"""A killed replica: its streams resume elsewhere, its sessions are rebound by the router's
rebinder, and with kvkeep's store their KV is restored instead of recomputed."""

from __future__ import annotations

import dataclasses

import pytest

from benchmarks.sim.cluster import Kill, Simulation
from benchmarks.sim.params import load_params
from benchmarks.sim.router_adapter import load_policies
from benchmarks.sim.workloads import ChatWorkload

_KILL_AT = 12.0


def _simulate(store: bool, node: bool, seed: int = 0) -> Simulation:
    params = load_params().with_overrides("engine", kv_tokens=16384, block_size=16)
    params = params.with_overrides("store", replicas_per_node=2)
    wl = ChatWorkload(sessions=48, session_rate=4.0, turns=4, system_prompts=2,
                      system_tokens=600, user_tokens=120, output_tokens=150, think_s=3.0,
                      vocab=params.model.vocab, block_size=16, seed=seed)
    spec = dataclasses.replace(load_policies()["kvkeep"], store=store)
    sim = Simulation(params, spec, wl, replicas=4, seed=seed, kills=[Kill(_KILL_AT, (0,), node)])
    sim.run()
    return sim


def _after_kill(sim: Simulation) -> list:  # type: ignore[type-arg]
    first = {}
    for r in sorted(sim.records, key=lambda r: r.sent_at):
        s = r.spec.session
        if s in sim.affected and s not in first and (r.sent_at >= _KILL_AT or r.broken_at):
            first[s] = r
    return list(first.values())


@pytest.mark.parametrize("node", [False, True])
def test_killed_replica_sessions_move_and_restore(node: bool) -> None:
    with_store, without = _simulate(True, node), _simulate(False, node)
    for sim in (with_store, without):
        assert sim.affected, "the kill hit no session"
        assert all(r.failed is None for r in sim.records), "a session was lost"
        assert sim.router.bound_sessions("w0") == []
        lease_end = _KILL_AT + sim.params.router.lease_ttl_s
        assert all("w0" not in r.workers for r in sim.records if r.sent_at > lease_end)
        assert sim.moved_sessions > 0
        # every session finished all its turns
        turns: dict[str | None, int] = {}
        for r in sim.records:
            turns[r.spec.session] = max(turns.get(r.spec.session, 0), r.spec.turn)
        assert set(turns.values()) == {3}
    restored = sum(r.host_tokens + r.remote_tokens for r in _after_kill(with_store))
    assert restored > 0
    assert sum(r.host_tokens + r.remote_tokens for r in _after_kill(without)) == 0
    if node:
        # the node's host tier died with it: what came back came from remote daemons or the
        # surviving node's tier (never from the dead node's)
        assert sum(r.remote_tokens for r in _after_kill(with_store)) > 0


def test_broken_streams_resume_with_the_tokens_already_sent() -> None:
    sim = _simulate(True, False)
    resumed = [r for r in sim.records if r.broken_at is not None]
    assert resumed, "no stream was in flight at the kill"
    for r in resumed:
        assert r.resumes == 1 and r.failed is None
        assert r.workers[0] == "w0" and r.workers[-1] != "w0"
        assert r.resumed_token_at is not None and r.broken_at is not None
        assert r.resumed_token_at > r.broken_at
        assert r.delivered == len(r.spec.output)
