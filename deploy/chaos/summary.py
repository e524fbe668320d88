"""A scenario run's figures: the JSON report's fields, how each is counted, and its table.

- `sessions`, `turns`: planned; `turns_done`: answered without error.
- `lost_sessions`: sessions with a failed turn, turns never sent, or no binding on a live worker
  at the end.
- `client_errors`: turns whose answer was an error (after retries on other routers, which only
  happen for failed connections).
- `outputs_differing_from_reference`: error-free answers whose text is not the reference's.
- `corrupt_reads_served`: frames that passed verification with content differing from the
  original, found by probing every corrupted block on every daemon at the end (see
  `storage.py`), plus answers that differ from their reference on turns that used KV from
  elsewhere (a restore hint, a resumption or a retry, with cached tokens): where corrupt KV
  would show. A verified frame that differs from the original only as a recomputation of the
  same block does (its corrupted copy dropped, the block recomputed and saved again: values
  within a few bf16 units of the original's) is `corrupt_probe.replaced`, not corrupt.
  `corrupt_blocks_detected` (the daemons' own counters) says the corruption was met at all.
- `restored_tokens`, `recomputed_tokens`: vLLM's counters on the workers (see `counters.py`).
- `registrations_lost`: every worker or daemon registration that left etcd (`registrations.py`);
  `unexplained_registration_losses`: those of a part no fault had killed or cut off, a finding
  (routers then treat a live worker as dead), reported without failing the run. The records a
  `bad_records` fault wrote and deleted are not registrations and are left out.
- `forged_requests`: HTTP requests that reached a `bad_records` fault's forged worker,
  connections to its forged daemon, and a router seen listing the claimed worker at the forged
  URL (each counts one); must be 0.
- `failover_detect_s`: per fault that makes a worker unusable, the time until every router
  dropped it. `resume_ttft_s`: the client's wait across a break, from the last token before it
  to the first after (a stream resumed by the router, or a turn re-sent to another router).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any, TextIO

from deploy.chaos.client import TurnRecord
from deploy.chaos.counters import CounterTally
from deploy.chaos.faults import FaultRecord
from deploy.chaos.registrations import Departure
from deploy.chaos.storage import ProbeResult
from deploy.chaos.traffic import SessionScript

__all__ = ["RunFacts", "summarize", "print_table", "ROOT_SKIPS"]

ROOT_SKIPS = ("root", "not installed", "not on a tmpfs", "not in a network namespace")
"""A fault skipped for one of these reasons lacked privileges or tools, not a target."""


@dataclass(frozen=True, slots=True)
class RunFacts:
    scripts: list[SessionScript]
    references: dict[str, list[str]]
    records: list[TurnRecord]
    faults: list[FaultRecord]
    engines: CounterTally
    daemons: CounterTally
    probe: ProbeResult
    unbound_sessions: list[str]
    load_seconds: float
    departures: list[Departure]
    t0: float
    """The load's start (monotonic): every `_s` time in the report counts from it."""


def _pct(values: Iterable[float], *qs: float) -> dict[str, float | None]:
    import numpy as np

    data = [v for v in values if v is not None]
    names = {50.0: "p50", 99.0: "p99", 100.0: "max"}
    if not data:
        return {names[q]: None for q in qs}
    return {names[q]: round(float(np.percentile(data, q)), 3) for q in qs}


# Faults that make a registration leave, by the kind of part; the lease runs out after the
# fault, so a departure up to the TTL (and some scheduling slack) later is still explained.
_EXPLAINS = {"worker": ("kill_worker", "partition"),
             "daemon": ("kill_daemon", "corrupt_blocks", "slow_daemon")}
_SLACK_S = 6.0


def _departures(facts: RunFacts) -> list[dict[str, Any]]:
    out = []
    written = {str(k).rsplit("/", 1)[-1] for f in facts.faults
               for k in f.numbers.get("keys", ())}
    for d in facts.departures:
        left = d.left_at - facts.t0
        if d.name in written:  # a bad record the bad_records fault wrote and deleted
            continue
        cause = next((f for f in facts.faults if f.target == d.name
                      and f.kind in _EXPLAINS[d.kind] and f.started_s is not None
                      and f.started_s - 0.5 <= left <= (f.ended_s or left) + _SLACK_S), None)
        out.append({"kind": d.kind, "name": d.name, "left_s": round(left, 3),
                    "gone_s": None if d.back_at is None else round(d.back_at - d.left_at, 3),
                    "explained_by": None if cause is None else f"{cause.kind}@{cause.at_s:g}"})
    return out


def _used_foreign_kv(r: TurnRecord) -> bool:
    return bool(r.restore_hint or r.resumptions or r.retries) and bool(r.cached_tokens)


def summarize(facts: RunFacts) -> dict[str, Any]:
    by_turn = {(r.session_id, r.index): r for r in facts.records}
    planned = sum(len(s.questions) for s in facts.scripts)
    errors = [r for r in facts.records if r.error is not None]
    differing = [r for r in facts.records if r.error is None
                 and r.text != facts.references[r.session_id][r.index]]
    lost = sorted({s.session_id for s in facts.scripts
                   if any((s.session_id, k) not in by_turn
                          or by_turn[(s.session_id, k)].error is not None
                          for k in range(len(s.questions)))} | set(facts.unbound_sessions))
    resumptions = [x for r in facts.records for x in r.resumptions]
    retries = [x for r in facts.records for x in r.retries]
    detects = [f.detect_s for f in facts.faults if f.detect_s is not None]
    departures = _departures(facts)
    failover_turns = [r.ttft_s for r in facts.records
                      if r.route in ("failover", "migrated") and r.ttft_s is not None]
    return {
        "sessions": len(facts.scripts),
        "turns": planned,
        "turns_done": len(facts.records) - len(errors),
        "lost_sessions": len(lost),
        "lost_session_ids": lost,
        "client_errors": len(errors),
        "client_error_samples": [f"{r.session_id}#{r.index}: {r.error}" for r in errors[:5]],
        "outputs_differing_from_reference": len(differing),
        "differing_turns": [f"{r.session_id}#{r.index}" for r in differing[:20]],
        "corrupt_reads_served": facts.probe.served_corrupt
        + sum(1 for r in differing if _used_foreign_kv(r)),
        "corrupt_blocks_detected": facts.daemons.total("corrupt_blocks"),
        "corrupt_probe": asdict(facts.probe),
        "restored_tokens": facts.engines.total("restored_tokens"),
        "recomputed_tokens": facts.engines.total("recomputed_tokens"),
        "local_prefix_hit_tokens": facts.engines.total("local_hit_tokens"),
        "failover_detect_s": _pct(detects, 50, 100),
        "resume_ttft_s": _pct([x.gap_s for x in resumptions if x.gap_s is not None]
                              + [x.gap_s for x in retries if x.gap_s is not None], 50, 99),
        "ttft_s": _pct([r.ttft_s for r in facts.records if r.ttft_s is not None], 50, 99),
        "failover_turn_ttft_s": _pct([t for t in failover_turns if t is not None], 50, 99),
        "resumed_streams": sum(1 for r in facts.records if r.resumptions),
        "retried_turns": sum(1 for r in facts.records if r.retries),
        "restore_hint_turns": sum(1 for r in facts.records if r.restore_hint),
        "daemon_puts": facts.daemons.total("puts"),
        "daemon_rejected_puts": facts.daemons.total("rejected_puts"),
        "daemon_hits": facts.daemons.total("hits"),
        "daemon_misses": facts.daemons.total("misses"),
        "load_seconds": round(facts.load_seconds, 1),
        "registrations_lost": departures,
        "unexplained_registration_losses": sum(1 for d in departures
                                               if d["explained_by"] is None),
        "forged_requests": sum(int(f.numbers.get("forged_worker_requests", 0))
                               + int(f.numbers.get("forged_daemon_connections", 0))
                               + int(bool(f.numbers.get("claimed_worker_repointed")))
                               for f in facts.faults),
        "faults": [f.as_dict() for f in facts.faults],
    }


_ROWS = (
    ("sessions", "sessions"), ("turns", "turns"), ("turns answered", "turns_done"),
    ("lost sessions", "lost_sessions"), ("client errors", "client_errors"),
    ("outputs differing from reference", "outputs_differing_from_reference"),
    ("corrupt reads served", "corrupt_reads_served"),
    ("corrupt blocks detected (daemons)", "corrupt_blocks_detected"),
    ("restored tokens", "restored_tokens"), ("recomputed tokens", "recomputed_tokens"),
    ("streams resumed by a router", "resumed_streams"),
    ("turns re-sent to another router", "retried_turns"),
    ("turns with a restore hint", "restore_hint_turns"),
    ("registrations lost (no fault explains)", "unexplained_registration_losses"),
    ("requests to forged workers or daemons", "forged_requests"),
    ("failover detect s (p50 / max)", "failover_detect_s"),
    ("resume TTFT s (p50 / p99)", "resume_ttft_s"), ("TTFT s (p50 / p99)", "ttft_s"),
    ("failover-turn TTFT s (p50 / p99)", "failover_turn_ttft_s"),
)


def _cell(value: Any) -> str:
    if isinstance(value, dict):
        return " / ".join("-" if v is None else f"{v:.3f}" for v in value.values())
    return str(value)


def print_table(summary: dict[str, Any], out: TextIO, title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(file=out, width=110, force_terminal=False, color_system=None)
    figures = Table(title=title, show_header=True)
    figures.add_column("figure")
    figures.add_column("value", justify="right")
    for label, key in _ROWS:
        figures.add_row(label, _cell(summary[key]))
    console.print(figures)
    faults = Table(title="faults", show_header=True)
    for name in ("at s", "kind", "target", "detect s", "recovered s", "what happened"):
        faults.add_column(name, overflow="fold")
    for f in summary["faults"]:
        what = (f"SKIPPED: {f['skipped']}" if f["skipped"] else
                f"ERROR: {f['error']}" if f["error"] else f["detail"])
        faults.add_row(f"{f['started_s'] if f['started_s'] is not None else f['at_s']:.1f}",
                       f["kind"], str(f["target"] or "-"),
                       "-" if f["detect_s"] is None else f"{f['detect_s']:.2f}",
                       "-" if f["recovered_s"] is None else f"{f['recovered_s']:.1f}", what)
    console.print(faults)
