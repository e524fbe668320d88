"""The faults of a scenario, done to a local cluster, each on its own thread at its time.

Every fault picks its target when it fires (never the last live worker, daemon or router, and
never a part another fault is holding), records what it did and when (`FaultRecord`), and
undoes itself (restart, SIGCONT, free the disk, heal the cut) before its thread ends. What needs
root (namespaces, a tmpfs) is skipped with the reason when the run is not root; a skipped fault
is in the report as such, never silently dropped.

Measured here: `detect_s`, from the fault to every live router dropping the worker (a killed
worker, or one cut off from etcd whose lease runs out); `recovered_s`, from the fault's end to
the part serving again (routers see the worker, the daemon answers health).
"""

from __future__ import annotations

import contextlib
import random
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import httpx

from deploy.chaos import storage
from deploy.chaos.counters import Poller, daemon_counters, daemon_refusals
from deploy.chaos.forgeries import Forgery
from deploy.chaos.scenario import (
    AnyFault,
    BadRecords,
    CorruptBlocks,
    FillDisk,
    KillDaemon,
    KillRouter,
    KillWorker,
    Partition,
    PauseEtcd,
    RestartEtcd,
    SlowDaemon,
)
from deploy.chaos.traffic import Streams
from deploy.local.cluster import LocalCluster
from deploy.local.disks import tmpfs_available
from deploy.local.probes import daemon_serving, http_json
from kvstore.errors import KVKeepError

__all__ = ["FaultRecord", "FaultContext", "Schedule"]


@dataclass
class FaultRecord:
    kind: str
    at_s: float
    """When the scenario asked for it (seconds after the load started)."""
    started_s: float | None = None
    """When it struck (after waiting for a live stream or for writes, where it waits)."""
    started_wall: str | None = None
    """The same instant on the wall clock, to find it in the cluster's logs."""
    ended_s: float | None = None
    target: str | None = None
    detail: str = ""
    skipped: str | None = None
    detect_s: float | None = None
    recovered_s: float | None = None
    error: str | None = None
    numbers: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {k: (round(v, 3) if isinstance(v, float) else v)
                for k, v in self.__dict__.items()}


@dataclass
class FaultContext:
    cluster: LocalCluster
    streams: Streams
    workers: Poller
    daemons: Poller
    rng: random.Random
    t0: float
    say: Callable[[str], None]
    corrupted: list[storage.CorruptedBlock] = field(default_factory=list)
    held: set[str] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def rel(self, t: float | None = None) -> float:
        return (time.monotonic() if t is None else t) - self.t0

    def serving_workers(self) -> list[str]:
        """Workers alive and usable on every live router (not one still starting)."""
        views = self.routers_usable()
        usable = set.intersection(*views) if views else set()
        return [w for w in self.cluster.alive_workers() if w in usable]

    def alive_daemons(self) -> list[str]:
        return [d.node_id for d in self.cluster.daemons if d.process.alive]

    def alive_routers(self) -> list[str]:
        return [r.replica_id for r in self.cluster.routers if r.process.alive]

    def claim(self, target: str) -> None:
        with self.lock:
            self.held.add(target)

    def release(self, target: str) -> None:
        with self.lock:
            self.held.discard(target)

    def pick(self, wanted: str, alive: list[str], *, keep_one: bool = True) -> str:
        """`wanted` or a random free part of `alive`; raises _Skip when none may be hit."""
        with self.lock:
            free = [a for a in alive if a not in self.held]
            if keep_one and len(alive) < 2:
                raise _Skip(f"only {len(alive)} alive: never the last one")
            if wanted != "random":
                if wanted not in alive:
                    raise _Skip(f"{wanted} is not alive")
                if wanted in self.held:
                    raise _Skip(f"{wanted} is under another fault")
                choice = wanted
            elif not free:
                raise _Skip("every candidate is under another fault")
            else:
                choice = self.rng.choice(sorted(free))
            self.held.add(choice)
            return choice

    def routers_usable(self) -> list[set[str]]:
        """Each live router's usable workers (unreachable routers left out)."""
        out = []
        for r in self.cluster.routers:
            if not r.process.alive:
                continue
            listed = http_json(f"{r.url}/kvkeep/workers", timeout=2.0)
            if isinstance(listed, list):
                out.append({str(w["id"]) for w in listed
                            if isinstance(w, dict) and w.get("usable")})
        return out

    def wait_dropped(self, worker: str, since: float, timeout_s: float = 30.0) -> float | None:
        """Seconds from `since` until no live router counts `worker` usable; None on timeout."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            views = self.routers_usable()
            if views and all(worker not in v for v in views):
                return time.monotonic() - since
            time.sleep(0.05)
        return None

    def daemon_token(self) -> str | None:
        return self.cluster.peer_token


class _Skip(Exception):
    pass


class Schedule:
    """Fires every fault at its time on a thread of its own; `join` waits for all to end."""

    def __init__(self, faults: tuple[AnyFault, ...], ctx: FaultContext) -> None:
        self.faults = sorted(faults, key=lambda f: f.at)
        self._ctx = ctx
        self.records = [FaultRecord(kind=_kind(f), at_s=f.at) for f in self.faults]
        self._threads: list[threading.Thread] = []
        self._timer = threading.Thread(target=self._fire_all, name="chaos-schedule", daemon=True)

    def start(self) -> None:
        self._timer.start()

    def join(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        self._timer.join(max(0.0, deadline - time.monotonic()))
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return not self._timer.is_alive() and not any(t.is_alive() for t in self._threads)

    def _fire_all(self) -> None:
        for fault, record in zip(self.faults, self.records, strict=True):
            time.sleep(max(0.0, self._ctx.t0 + fault.at - time.monotonic()))
            thread = threading.Thread(target=self._run, args=(fault, record),
                                      name=f"chaos-{record.kind}", daemon=True)
            self._threads.append(thread)
            thread.start()

    def _run(self, fault: AnyFault, record: FaultRecord) -> None:
        ctx = self._ctx
        try:
            _DO[type(fault)](fault, record, ctx)
        except _Skip as skip:
            record.skipped = str(skip)
        except Exception as exc:  # a fault that failed is reported, and the run goes on
            record.error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        finally:
            record.ended_s = ctx.rel()
            if record.target is not None:
                ctx.release(record.target)
        what = f"{record.kind} {record.target or ''}".strip()
        if record.skipped:
            ctx.say(f"fault {what} skipped: {record.skipped}")
        elif record.error:
            ctx.say(f"fault {what} FAILED: {record.error}")
        else:
            ctx.say(f"fault {what} done: {record.detail}")


def _kind(fault: AnyFault) -> str:
    return type(fault).__struct_config__.tag  # type: ignore[return-value]


def _strike(record: FaultRecord, ctx: FaultContext, target: str) -> None:
    record.target = target
    record.started_s = ctx.rel()
    record.started_wall = time.strftime("%H:%M:%S", time.localtime()) + \
        f".{int(time.time() * 1000) % 1000:03d}"
    ctx.say(f"*** {record.kind} {target} at {record.started_s:.1f}s ***")


def _kill_worker(f: KillWorker, record: FaultRecord, ctx: FaultContext) -> None:
    ctx.workers.poll()  # the counters of whoever dies, as close before as the wait allows
    wanted = f.target
    note = ""
    serving = ctx.serving_workers()
    if wanted == "busy":
        busy, serving = _wait_busy(ctx, f.mid_stream_chunks, f.mid_stream_left,
                                    timeout_s=20.0)
        wanted = busy or "random"
        note = "mid-stream" if busy else "no stream was live: a random worker"
    # No call between the choice (`_wait_busy`'s last look at the client's streams) and the
    # kill: a stream of the tiny model moves on by about a token every 10 ms, so a kill that
    # waits on the routers would land past its end.
    target = ctx.pick(wanted, serving)
    live = ctx.streams.busy(0).get(target, 0)
    _strike(record, ctx, target)
    killed = ctx.cluster.kill_worker(target)
    record.detect_s = ctx.wait_dropped(target, killed)
    record.detail = (f"SIGKILL vLLM and agent ({note or 'as named'}; a live stream of it had "
                     f"{live} tokens to go); routers dropped it after "
                     + (f"{record.detect_s:.2f}s" if record.detect_s is not None else "NEVER"))
    record.numbers["live_stream_tokens_left"] = live
    _restart_later(f.restart_after, record, partial(ctx.cluster.restart_worker, target),
                   "restarted, serving again after {:.0f}s")


def _wait_busy(ctx: FaultContext, chunks: int, left: int, timeout_s: float
               ) -> tuple[str | None, list[str]]:
    """A serving worker with a stream past `chunks` chunks and `left` tokens from its end
    (None after `timeout_s`), and the workers serving as last seen.

    The streams are counted as the client reads them, which is behind the engine (tokens wait
    in the router's and the sockets' buffers), so a stream the client sees `left` tokens from
    its end may have ended on the worker; a candidate is taken only once its engine says it is
    running a request (vLLM's `num_requests_running`), so the kill lands on a live stream."""
    deadline = time.monotonic() + timeout_s
    serving: set[str] = set()
    asked = 0.0
    while time.monotonic() < deadline:
        if time.monotonic() - asked > 0.5:  # the routers' view, twice a second
            serving, asked = set(ctx.serving_workers()), time.monotonic()
        with ctx.lock:
            busy = {w: n for w, n in ctx.streams.busy(chunks, min_left=left).items()
                    if w in serving and w not in ctx.held}
        if busy and len(serving) >= 2:
            chosen = max(sorted(busy), key=lambda w: busy[w])
            # The engine's answer takes a while on a loaded machine (one CI run's kill landed
            # after the chosen stream had ended: "0 tokens to go"), so the client's count is
            # read again after it: the kill follows a look at both that found the stream live.
            if _engine_running(ctx.cluster.workers[chosen].url) > 0 and \
                    chosen in ctx.streams.busy(chunks, min_left=left // 2):
                return chosen, sorted(serving)
        time.sleep(0.01)
    return None, sorted(serving)


def _engine_running(worker_url: str) -> float:
    """Requests vLLM is running now (its `num_requests_running` gauge); 0 when unreadable."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = httpx.get(f"{worker_url}/metrics", timeout=1.0).text
    except httpx.HTTPError:
        return 0.0
    return sum(sample.value for family in text_string_to_metric_families(text)
               if family.name == "vllm:num_requests_running" for sample in family.samples)


def _kill_daemon(f: KillDaemon, record: FaultRecord, ctx: FaultContext) -> None:
    target = ctx.pick(f.target, ctx.alive_daemons())
    d = ctx.cluster.daemon(target)
    note = "as scheduled"
    if f.during_writes:
        grew = _wait_puts(d.address, ctx.daemon_token(), timeout_s=15.0)
        note = (f"while puts arrived (+{grew} in the last 50 ms)" if grew
                else "no put arrived in 15 s: killed anyway")
        record.numbers["puts_in_last_50ms"] = grew
    ctx.daemons.poll(target)
    _strike(record, ctx, target)
    ctx.cluster.kill_daemon(target)
    record.detail = f"SIGKILL {note}"
    _restart_later(f.restart_after, record, partial(ctx.cluster.restart_daemon, target),
                   "restarted on its disk, serving after {:.1f}s")


def _wait_puts(address: str, token: str | None, timeout_s: float) -> int:
    """Block until the daemon's put counter grows between two polls 50 ms apart."""
    deadline = time.monotonic() + timeout_s
    last = daemon_counters(address, token)
    while time.monotonic() < deadline:
        time.sleep(0.05)
        now = daemon_counters(address, token)
        if last is not None and now is not None and now["puts"] > last["puts"]:
            return int(now["puts"] - last["puts"])
        last = now
    return 0


def _kill_router(f: KillRouter, record: FaultRecord, ctx: FaultContext) -> None:
    target = ctx.pick(f.target, ctx.alive_routers())
    _strike(record, ctx, target)
    ctx.cluster.kill_router(target)
    record.detail = f"SIGKILL ({ctx.streams.count()} streams live)"
    _restart_later(f.restart_after, record, partial(ctx.cluster.restart_router, target),
                   "restarted, serving after {:.1f}s")


def _restart_later(after_s: float | None, record: FaultRecord, restart: Callable[[], None],
                   said: str) -> None:
    """A killed part's restart `after_s` later (never when None), timed into `record`;
    `said` formats the seconds it took into the record's detail."""
    if after_s is None:
        return
    time.sleep(after_s)
    back = time.monotonic()
    restart()
    record.recovered_s = time.monotonic() - back
    record.detail += "; " + said.format(record.recovered_s)


def _pause_etcd(f: PauseEtcd, record: FaultRecord, ctx: FaultContext) -> None:
    ctx.pick("etcd", ["etcd"], keep_one=False)
    _strike(record, ctx, "etcd")
    before = _usable_everywhere(ctx)
    ctx.cluster.signal_etcd(signal.SIGSTOP)
    try:
        time.sleep(f.duration)
    finally:
        ctx.cluster.signal_etcd(signal.SIGCONT)
    dropped = _watch_registrations(ctx, before, seconds=3.0)
    record.numbers["workers_dropped_after"] = sorted(dropped)
    record.detail = (f"SIGSTOP for {f.duration:g}s, then SIGCONT; "
                     + (f"routers dropped {sorted(dropped)} afterwards" if dropped
                        else "every worker stayed registered"))


def _restart_etcd(f: RestartEtcd, record: FaultRecord, ctx: FaultContext) -> None:
    ctx.pick("etcd", ["etcd"], keep_one=False)
    _strike(record, ctx, "etcd")
    before = _usable_everywhere(ctx)
    ctx.cluster.signal_etcd(signal.SIGKILL)
    time.sleep(f.down_for)
    back = time.monotonic()
    ctx.cluster.restart_etcd()
    record.recovered_s = time.monotonic() - back
    dropped = _watch_registrations(ctx, before, seconds=3.0)
    record.numbers["workers_dropped_after"] = sorted(dropped)
    record.detail = (f"SIGKILL, down {f.down_for:g}s, restarted on its data dir in "
                     f"{record.recovered_s:.1f}s; "
                     + (f"routers dropped {sorted(dropped)} afterwards" if dropped
                        else "every worker stayed registered"))


def _usable_everywhere(ctx: FaultContext) -> list[str]:
    views = ctx.routers_usable()
    return sorted(set.intersection(*views)) if views else []


def _watch_registrations(ctx: FaultContext, workers: list[str], seconds: float) -> set[str]:
    """Workers (alive throughout) some router stopped counting usable in the next seconds
    (polled every 0.1 s: a shorter absence shows in the registration watch only)."""
    dropped: set[str] = set()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for view in ctx.routers_usable():
            dropped |= {w for w in workers if w not in view
                        and ctx.cluster.workers[w].alive}
        time.sleep(0.1)
    return dropped


def _fill_disk(f: FillDisk, record: FaultRecord, ctx: FaultContext) -> None:
    why = tmpfs_available()
    if why is not None or not ctx.cluster.spec.daemon_disk_tmpfs:
        raise _Skip(why or "the daemons' data dirs are not on a tmpfs")
    target = ctx.pick(f.target, ctx.alive_daemons(), keep_one=False)
    d = ctx.cluster.daemon(target)
    token = ctx.daemon_token()
    before = daemon_counters(d.address, token) or {}
    metrics_url = f"http://{d.host}:{d.metrics_port}"
    refused_before = daemon_refusals(metrics_url, "RESOURCE_EXHAUSTED") or 0.0
    _strike(record, ctx, target)
    written = storage.fill_disk(d.data_dir)
    serving = True
    try:
        deadline = time.monotonic() + f.duration
        while time.monotonic() < deadline:
            serving = serving and daemon_serving(d.node_id, d.address)
            time.sleep(0.5)
        during = daemon_counters(d.address, token) or {}
        refused_during = daemon_refusals(metrics_url, "RESOURCE_EXHAUSTED") or refused_before
    finally:
        storage.free_disk(d.data_dir)
    freed = time.monotonic()
    # Space is back: writes must reach the disk again without a restart.
    accepted = _disk_writes_again(d.address, token, during, timeout_s=30.0)
    record.recovered_s = time.monotonic() - freed if accepted else None
    # Refused at admission (RESOURCE_EXHAUSTED, the daemon's own statvfs check) or, for a put
    # already admitted when the disk filled, by the nvme tier itself.
    rejected = int(during.get("nvme_rejected_puts", 0) - before.get("nvme_rejected_puts", 0)
                   + refused_during - refused_before)
    record.numbers.update(filler_bytes=written, refused_puts=rejected,
                          served_health_throughout=serving,
                          disk_writes_after_free=accepted)
    record.detail = (f"filled its tmpfs ({written >> 20} MiB) for {f.duration:g}s: "
                     f"{rejected} puts refused (disk full), health "
                     f"{'SERVING throughout' if serving else 'NOT serving at some point'}; "
                     + (f"its disk took writes again {record.recovered_s:.1f}s after it was "
                        "freed" if accepted else
                        "its disk took NO write in the 30 s after it was freed"))


def _disk_writes_again(address: str, token: str | None, since: dict[str, float],
                       timeout_s: float) -> bool:
    """Whether the daemon's nvme tier stores a block again within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        now = daemon_counters(address, token)
        if now is not None and now.get("nvme_puts", 0) > since.get("nvme_puts", 0):
            return True
        time.sleep(0.5)
    return False


def _corrupt_blocks(f: CorruptBlocks, record: FaultRecord, ctx: FaultContext) -> None:
    target = ctx.pick(f.target, ctx.alive_daemons(), keep_one=f.restart)
    d = ctx.cluster.daemon(target)
    _strike(record, ctx, target)
    done = storage.corrupt_blocks(target, d.data_dir, f.blocks, ctx.rng)
    ctx.corrupted.extend(done)
    record.numbers["corrupted_blocks"] = len(done)
    record.detail = (f"flipped bytes in {len(done)} of its newest block files "
                     f"({sum(c.where == 'header' for c in done)} in the header)")
    if f.restart:
        ctx.daemons.poll(target)
        ctx.cluster.kill_daemon(target)
        back = time.monotonic()
        ctx.cluster.restart_daemon(target)
        record.recovered_s = time.monotonic() - back
        record.detail += "; SIGKILLed and restarted: its reads come from that disk now"


def _slow_daemon(f: SlowDaemon, record: FaultRecord, ctx: FaultContext) -> None:
    target = ctx.pick(f.target, ctx.alive_daemons(), keep_one=False)
    process = ctx.cluster.daemon(target).process
    _strike(record, ctx, target)
    bursts = 0
    deadline = time.monotonic() + f.duration
    try:
        while time.monotonic() < deadline and process.alive:
            process.signal(signal.SIGSTOP)
            time.sleep(f.stop_ms / 1000)
            process.signal(signal.SIGCONT)
            bursts += 1
            time.sleep(f.run_ms / 1000)
    finally:
        process.signal(signal.SIGCONT)
    record.numbers["bursts"] = bursts
    record.detail = (f"{bursts} SIGSTOP/SIGCONT bursts over {f.duration:g}s "
                     f"({f.stop_ms} ms stopped, {f.run_ms} ms running)")


def _partition(f: Partition, record: FaultRecord, ctx: FaultContext) -> None:
    fabric = ctx.cluster.fabric
    if fabric is None or f.target not in fabric.nodes:
        from deploy.local.netns import netns_available

        raise _Skip(netns_available() or f"{f.target} is not in a network namespace")
    if f.target not in ctx.serving_workers():  # still starting after a kill: wait for it
        with contextlib.suppress(KVKeepError):
            ctx.cluster.wait_routers_see({f.target}, timeout=180.0)
    ctx.pick(f.target, ctx.serving_workers(), keep_one=False)
    _strike(record, ctx, f.target)
    cut = time.monotonic()
    fabric.cut(f.target, f.from_)
    try:
        if f.from_ == "etcd":
            record.detect_s = ctx.wait_dropped(f.target, cut, timeout_s=f.duration)
        time.sleep(max(0.0, cut + f.duration - time.monotonic()))
    finally:
        fabric.heal(f.target, f.from_)
    healed = time.monotonic()
    with contextlib.suppress(KVKeepError):
        ctx.cluster.wait_routers_see({f.target}, timeout=60.0)
        record.recovered_s = time.monotonic() - healed
    detected = ("" if f.from_ != "etcd" else
                "; routers dropped it after " + (f"{record.detect_s:.2f}s" if record.detect_s
                                                 is not None else "NEVER (within the cut)"))
    record.detail = (f"cut off from {f.from_} for {f.duration:g}s (packets lost silently)"
                     f"{detected}; "
                     + (f"usable on every router {record.recovered_s:.1f}s after the heal"
                        if record.recovered_s is not None else
                        "NOT usable again within 60 s of the heal"))


def _bad_records(f: BadRecords, record: FaultRecord, ctx: FaultContext) -> None:
    _strike(record, ctx, "etcd")
    forgery = Forgery(ctx.cluster, f.target)
    repointed = False
    try:
        forgery.write()
        record.numbers["keys"] = list(forgery.keys)
        deadline = time.monotonic() + f.duration
        while time.monotonic() < deadline:
            repointed = repointed or not forgery.claimed_url_everywhere()
            time.sleep(0.5)
    finally:
        forgery.remove()
        time.sleep(1.0)  # a request already on its way to a capture server is still counted
        forgery.close()
    record.numbers.update(forgery.counts())
    record.numbers["claimed_worker_repointed"] = repointed
    record.detail = (f"{len(forgery.keys)} bad records for {f.duration:g}s (poison and mistyped "
                     f"values under workers/, sessions/, stores/; {f.target} and d1 forged): "
                     f"{forgery.worker.requests} requests reached the forged worker, "
                     f"{forgery.daemon.connections} connections the forged daemon; "
                     f"{f.target} re-pointed on a router: {repointed}")


_DO: dict[type, Callable[[Any, FaultRecord, FaultContext], None]] = {
    KillWorker: _kill_worker, KillDaemon: _kill_daemon, KillRouter: _kill_router,
    PauseEtcd: _pause_etcd, RestartEtcd: _restart_etcd, FillDisk: _fill_disk,
    CorruptBlocks: _corrupt_blocks, SlowDaemon: _slow_daemon, Partition: _partition,
    BadRecords: _bad_records,
}
