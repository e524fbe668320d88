"""A chaos scenario file (YAML): the cluster, the load, and the fault schedule.

    name: ci-quick                      # a name with `ci` in it runs in `make test`
    seed: 0
    cluster: {workers: 2, daemons: 2, routers: 2, replicas: 2}
    load:
      sessions: 6                       # conversations, each `turns` turns long
      turns: 6
      duration_s: 60                    # a session's turns start duration_s / turns apart
      concurrency: 4                    # turns in flight at most
      max_tokens: [48, 96]              # each turn's answer length, drawn in this range
      user_words: [6, 30]
      shared_prefixes: 2                # distinct system prompts the sessions share
    faults:
      - {kind: kill_worker, at: 5, target: busy, restart_after: 0}
      - {kind: kill_daemon, at: 20, target: random, restart_after: 2}
      - {kind: pause_etcd, at: 35, duration: 4}

`at` is seconds after the load starts. Targets are names (`w1`, `d2`, `r1`) or `random`
(`busy` for workers: one streaming an answer, killed mid-stream). Every fault kind and its
fields are the classes below; unknown keys and kinds are errors naming the file and the key.
The shipped scenarios are `deploy/chaos/*.yaml`; README.md here documents them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import msgspec

from kvstore.errors import ConfigError

__all__ = ["ClusterPlan", "LoadPlan", "Fault", "KillWorker", "KillDaemon", "KillRouter",
           "PauseEtcd", "RestartEtcd", "FillDisk", "CorruptBlocks", "SlowDaemon", "Partition",
           "BadRecords", "Scenario", "load_scenario", "SCENARIO_DIR"]

SCENARIO_DIR = Path(__file__).resolve().parent


class _Strict(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    pass


class ClusterPlan(_Strict, frozen=True, forbid_unknown_fields=True, kw_only=True):
    workers: int = 2
    daemons: int = 2
    routers: int = 2
    replicas: int = 2
    """Copies of each block on the daemons (the connector's R and the daemons' re-replication)."""
    lease_ttl_s: float = 2.0
    """Worker agents' lease: a dead node is noticed within this."""
    daemon_mem_budget: str = "128MiB"
    daemon_disk_budget: str = "1GiB"
    daemon_disk_tmpfs: str | None = None
    """Each daemon's data dir on a tmpfs of this size (root only); `fill_disk` needs it."""
    max_model_len: int = 2048
    block_size: int = 32
    checkpoint_tokens: int = 32


class LoadPlan(_Strict, frozen=True, forbid_unknown_fields=True, kw_only=True):
    sessions: int
    turns: int
    duration_s: float
    concurrency: int
    max_tokens: tuple[int, int] = (48, 96)
    user_words: tuple[int, int] = (6, 30)
    shared_prefixes: int = 2
    prefix_words: tuple[int, int] = (60, 120)
    turn_timeout_s: float = 120.0
    """A turn taking longer than this (all its retries included) is a client error."""


class Fault(_Strict, tag_field="kind", frozen=True, forbid_unknown_fields=True,
            kw_only=True):
    at: float
    """Seconds after the load starts."""


class KillWorker(Fault, tag="kill_worker", frozen=True, forbid_unknown_fields=True,
         kw_only=True):
    """SIGKILL a worker's vLLM and its agent (the node dies: its lease expires)."""

    target: str = "busy"
    restart_after: float | None = 0.0
    """Seconds until it starts again (vLLM then takes tens of seconds); null: stays dead."""
    mid_stream_chunks: int = 8
    """`busy`: the kill comes once a stream on the victim has sent this many chunks."""
    mid_stream_left: int = 40
    """`busy`: ... and has at least this many tokens to go. The client counts what it has read,
    and it reads behind the engine (tokens wait in the router's and the sockets' buffers, the
    more so on a loaded machine). With 24, one CI run's kill interrupted no stream, most likely
    because the stream had already ended on the worker (that run's report did not say)."""


class KillDaemon(Fault, tag="kill_daemon", frozen=True, forbid_unknown_fields=True,
         kw_only=True):
    """SIGKILL a kvstore daemon, by default while blocks are being written to it."""

    target: str = "random"
    restart_after: float | None = 2.0
    during_writes: bool = True


class KillRouter(Fault, tag="kill_router", frozen=True, forbid_unknown_fields=True,
         kw_only=True):
    """SIGKILL a router replica; clients go on through the others (as behind a Service)."""

    target: str = "random"
    restart_after: float | None = 3.0


class PauseEtcd(Fault, tag="pause_etcd", frozen=True, forbid_unknown_fields=True,
         kw_only=True):
    """SIGSTOP etcd for `duration` seconds, then SIGCONT: a hung etcd."""

    duration: float = 3.0


class RestartEtcd(Fault, tag="restart_etcd", frozen=True, forbid_unknown_fields=True,
         kw_only=True):
    """SIGKILL etcd, start it again after `down_for` seconds (same data dir)."""

    down_for: float = 2.0


class FillDisk(Fault, tag="fill_disk", frozen=True, forbid_unknown_fields=True,
         kw_only=True):
    """Fill a daemon's tmpfs data dir to ENOSPC for `duration` seconds, then free it."""

    target: str = "random"
    duration: float = 10.0


class CorruptBlocks(Fault, tag="corrupt_blocks", frozen=True, forbid_unknown_fields=True,
         kw_only=True):
    """Flip bytes in `blocks` of a daemon's stored block files (the most recent ones)."""

    target: str = "random"
    blocks: int = 8
    restart: bool = False
    """SIGKILL and restart the daemon right after: its RAM copies are gone, reads hit disk."""


class SlowDaemon(Fault, tag="slow_daemon", frozen=True, forbid_unknown_fields=True,
         kw_only=True):
    """SIGSTOP/SIGCONT bursts on a daemon for `duration` s: stopped `stop_ms`, then running
    `run_ms`, again and again (a daemon that answers, slowly)."""

    target: str = "random"
    duration: float = 8.0
    stop_ms: int = 400
    run_ms: int = 100


class Partition(Fault, tag="partition", frozen=True, forbid_unknown_fields=True,
         kw_only=True):
    """Cut a worker node off from etcd or from the daemons for `duration` s (root: network
    namespaces, deploy/local/netns.py); the routers still reach it."""

    target: str
    from_: Literal["etcd", "daemons"] = msgspec.field(name="from")
    duration: float = 8.0


class BadRecords(Fault, tag="bad_records", frozen=True, forbid_unknown_fields=True,
                 kw_only=True):
    """Write what a hostile or careless etcd writer could, for `duration` s, then delete it: a
    poison value (3,000 levels of nesting) and a mistyped record under workers/, sessions/ and
    stores/; forged worker records claiming a real worker's id (no lease; and under a lease,
    in another key) pointing at a capture server; a forged daemon record (no lease) pointing
    at a capture socket. The run fails if the capture servers get a single request."""

    target: str = "w1"
    """The worker id the forged records claim."""
    duration: float = 10.0


AnyFault = (KillWorker | KillDaemon | KillRouter | PauseEtcd | RestartEtcd | FillDisk
            | CorruptBlocks | SlowDaemon | Partition | BadRecords)


class Scenario(_Strict, frozen=True, forbid_unknown_fields=True, kw_only=True):
    name: str
    load: LoadPlan
    description: str = ""
    seed: int = 0
    cluster: ClusterPlan = ClusterPlan()
    faults: tuple[AnyFault, ...] = ()

    @property
    def isolated_workers(self) -> tuple[str, ...]:
        """Workers a partition targets: they run in network namespaces of their own."""
        return tuple(sorted({f.target for f in self.faults if isinstance(f, Partition)}))

    @property
    def end_of_faults_s(self) -> float:
        return max((f.at for f in self.faults), default=0.0)


def load_scenario(path: Path) -> Scenario:
    """Read and check a scenario file; ConfigError naming the file and what is wrong."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"chaos scenario {path}: {exc}") from exc
    try:
        scenario = msgspec.yaml.decode(text.encode(), type=Scenario)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"chaos scenario {path}: {exc}") from exc
    except msgspec.DecodeError as exc:
        raise ConfigError(f"chaos scenario {path}: not YAML: {exc}") from exc
    return checked(scenario, str(path))


def checked(scenario: Scenario, source: str) -> Scenario:
    """`scenario` if it is runnable; else ConfigError naming `source` and what is wrong."""
    problems = _problems(scenario)
    if problems:
        raise ConfigError(f"chaos scenario {source}: " + "; ".join(problems))
    return scenario


# A killed worker restarts at once and its vLLM serves again ~40 s later: the next kill waits
# for it, so that each kill finds two live workers and strikes a stream mid-answer.
KILL_SPACING_S = 45.0
_FIRST_KILL_S = 4.0
_AFTER_LAST_KILL_S = 30.0


def kills_scenario(*, kills: int, sessions: int, max_tokens: int, seed: int,
                   workers: int = 2) -> Scenario:
    """`kvkeep chaos --kills N` as a scenario: streamed chat sessions through one router, and
    N SIGKILLs of a busy worker mid-answer, `KILL_SPACING_S` apart, each restarted at once.
    The scenario's checks decide, as for a file (no session lost, every answer equal to its
    reference, every kill struck)."""
    if kills < 0 or sessions < 1 or max_tokens < 16:
        raise ConfigError("chaos: --kills >= 0, --sessions >= 1 and --max-tokens >= 16 (the "
                          "kill comes mid-answer)")
    # The kill waits for a stream with this many tokens still to come (KillWorker's doc).
    left = min(40, max_tokens // 2)
    faults = tuple(KillWorker(at=_FIRST_KILL_S + i * KILL_SPACING_S, target="busy",
                              restart_after=0.0, mid_stream_left=left)
                   for i in range(kills))
    duration = _FIRST_KILL_S + max(kills - 1, 0) * KILL_SPACING_S + _AFTER_LAST_KILL_S
    return checked(Scenario(
        name=f"kills-{kills}", seed=seed,
        description=f"{kills} busy workers SIGKILLed mid-answer, {KILL_SPACING_S:g}s apart",
        cluster=ClusterPlan(workers=workers, routers=1),
        load=LoadPlan(sessions=sessions, turns=kills + 2, duration_s=duration,
                      concurrency=min(sessions, 4), max_tokens=(max_tokens, max_tokens)),
        faults=faults), f"--kills {kills}")


def _problems(s: Scenario) -> list[str]:
    c, load = s.cluster, s.load
    out: list[str] = []
    if not s.name.strip():
        out.append("name is empty")
    if min(c.workers, c.daemons, c.routers, c.replicas) < 1:
        out.append("cluster: workers, daemons, routers and replicas must be >= 1")
    if c.replicas > c.daemons:
        out.append(f"cluster: replicas {c.replicas} > daemons {c.daemons}")
    if min(load.sessions, load.turns, load.concurrency, load.shared_prefixes) < 1:
        out.append("load: sessions, turns, concurrency and shared_prefixes must be >= 1")
    if load.duration_s <= 0 or load.turn_timeout_s <= 0:
        out.append("load: duration_s and turn_timeout_s must be > 0")
    for name, (low, high) in (("max_tokens", load.max_tokens), ("user_words", load.user_words),
                              ("prefix_words", load.prefix_words)):
        if not 0 < low <= high:
            out.append(f"load: {name} [{low}, {high}] is not a range of positive numbers")
    names = {"worker": {f"w{i + 1}" for i in range(c.workers)},
             "daemon": {f"d{i + 1}" for i in range(c.daemons)},
             "router": {f"r{i + 1}" for i in range(c.routers)}}
    for i, f in enumerate(s.faults):
        where = f"faults[{i}] ({type(f).__name__})"
        if f.at < 0:
            out.append(f"{where}: at must be >= 0")
        for field in ("duration", "down_for", "restart_after"):
            value = getattr(f, field, 1.0)
            if value is not None and value < 0:
                out.append(f"{where}: {field} must be >= 0")
        kind, wildcards = _target_kind(f)
        target = getattr(f, "target", None)
        if kind and target not in names[kind] | wildcards:
            out.append(f"{where}: target {target!r} is none of "
                       f"{', '.join(sorted(names[kind] | wildcards))}")
        if isinstance(f, FillDisk) and c.daemon_disk_tmpfs is None:
            out.append(f"{where}: fill_disk needs cluster.daemon_disk_tmpfs (a disk that fills)")
        if isinstance(f, CorruptBlocks) and f.blocks < 1:
            out.append(f"{where}: blocks must be >= 1")
        if isinstance(f, SlowDaemon) and (f.stop_ms < 1 or f.run_ms < 1):
            out.append(f"{where}: stop_ms and run_ms must be >= 1")
    if s.end_of_faults_s >= load.duration_s:
        out.append(f"a fault at {s.end_of_faults_s:g}s comes after the load's "
                   f"duration_s {load.duration_s:g}: it would hit no traffic")
    return out


def _target_kind(f: Fault) -> tuple[str | None, set[str]]:
    if isinstance(f, KillWorker):
        return "worker", {"busy", "random"}
    if isinstance(f, Partition):
        return "worker", set()
    if isinstance(f, KillDaemon | FillDisk | CorruptBlocks | SlowDaemon):
        return "daemon", {"random"}
    if isinstance(f, KillRouter):
        return "router", {"random"}
    return None, set()
