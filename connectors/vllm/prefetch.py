"""Prefetch on the router's failover hint: a moved session's blocks reach host RAM before its
next turn does.

At failover the router that wins a session's rebinding writes a hint under the new worker's
own etcd prefix (kvstore/cluster/hints.py). Without one, this worker learns of the session
only when its next turn arrives, and then reads every block from the remote daemons while the
client waits (a slow daemon or a far node adds its latency to that turn's first token). With
`prefetch` configured, the worker half watches its prefix and, for each new hint, reads the
session's manifest and pulls its blocks up through the store (`TieredStore.pull_up`: read in
batches, verified, and written at once into the tiers above the one that held them, host RAM
first). The next turn's lookup then finds them in memory and restores them from there.

Bounds, since anyone who can write etcd chooses a hint's bytes (kvstore/cluster/hints.py):
hints older than `max_age_s` or seen before (same session and epoch) are skipped; at most
`MAX_QUEUED` wait, later ones are dropped and counted; one session pulls at most `max_blocks`
blocks; one session is read at a time (in `_STREAMS` read streams, as a restore reads), so
prefetch never takes more of the store's bandwidth than one restore does. Manifest and blocks
are read under this connector's own fingerprint and tenant: a hint cannot reach another
tenant's blocks or make anyone serve wrong KV.

Counted (connectors/vllm/stats.py): `prefetch_hints` (taken), `prefetch_blocks` (pulled up),
`prefetch_present` (already in host RAM), `prefetch_missing` (no manifest, or a block the
store no longer has), `prefetch_skipped` (stale, repeated, over the queue), `prefetch_errors`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

from connectors.vllm.config import PrefetchSpec
from connectors.vllm.params import namespace_for
from connectors.vllm.stats import Count, Counts
from kvstore.cluster.clients import FreshClients
from kvstore.cluster.hints import PrefetchHint, hints_prefix
from kvstore.cluster.records import EtcdRecord
from kvstore.cluster.watcher import PrefixWatcher, ThreadedWatch
from kvstore.errors import KVKeepError
from kvstore.keys import BlockKey, ModelFingerprint, SessionKey
from kvstore.store import PullUp, TieredStore

__all__ = ["Prefetcher", "MAX_QUEUED"]

log = logging.getLogger(__name__)

MAX_QUEUED = 256
"""Hints waiting to be read; a failover moves at most this many sessions to one worker at
once before later ones are dropped (and counted): each costs at most `max_blocks` reads."""
_REMEMBERED = 4096  # (session, epoch) pairs already taken: re-listings repeat every hint
_BATCH = 64
"""Blocks per `pull_up`: one pipelined read stream per daemon (memory: this many frames per
stream at most)."""
_STREAMS = 4
"""`pull_up`s at once, as the loader reads (`connectors.vllm.loader._READ_THREADS`): one
stream's throughput is its flow-control window per round trip, so through a link 50 ms long
one stream moved 64 blocks of 0.5 MiB in 3.6 s, and the loader's four in about 1 s."""
_BATCH_DEADLINE_S = 15.0
"""Per batch. No request waits on a prefetch, so it gets far more than the store's default
read deadline: a read cut short by one counts as the daemon's failure and opens its breaker
for every request of this worker (seen: 16 MiB through a slow link, default deadline)."""


class Prefetcher:
    """Follows one worker's hints and warms `store`'s upper tiers with the sessions' blocks.

    `manifest_fp`: the fingerprint the scheduler half writes manifests under (with tensor
    parallelism, rank 0's); `block_fp`: this worker's own (its shard's blocks)."""

    def __init__(self, *, store: TieredStore, spec: PrefetchSpec, tenant: str,
                 manifest_fp: ModelFingerprint, block_fp: ModelFingerprint,
                 counters: Counts) -> None:
        self._store = store
        self._spec = spec
        self._tenant = tenant
        self._manifest_fp = manifest_fp
        self._block_fp = block_fp
        self._counters = counters
        self._cond = threading.Condition()
        self._queue: deque[PrefetchHint] = deque()
        self._seen: OrderedDict[tuple[str, int], None] = OrderedDict()
        self._busy = False
        self._closed = False
        self._watcher = PrefixWatcher(
            FreshClients(spec.etcd), hints_prefix(spec.prefix, spec.worker_id), _decode, self,
            what="prefetch hint", require_lease=True, resync_s=30.0)
        self._watch = ThreadedWatch(self._watcher, "kvkeep-prefetch-watch")
        self._streams = ThreadPoolExecutor(_STREAMS, thread_name_prefix="kvkeep-prefetch-read")
        self._reader = threading.Thread(target=self._read_main, name="kvkeep-prefetch",
                                        daemon=True)
        self._reader.start()

    @property
    def rejected(self) -> dict[str, int]:
        """Hints ignored as untrusted or malformed, by reason."""
        return dict(self._watcher.rejected)

    def wait_synced(self, timeout: float) -> bool:
        """Wait for the first listing of the hints (tests, start-up)."""
        return self._watch.wait_synced(timeout)

    def idle(self) -> bool:
        """Nothing queued and nothing being read."""
        with self._cond:
            return not self._queue and not self._busy

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._queue.clear()
            self._cond.notify_all()
        self._watch.close()
        self._reader.join(5.0)
        self._streams.shutdown(wait=False, cancel_futures=True)

    # -- the watcher's sink (on the watch thread) -----------------------------------------

    def reset(self, items: Mapping[str, PrefetchHint]) -> None:
        for hint in items.values():
            self._offer(hint)

    def put(self, name: str, item: PrefetchHint) -> None:
        self._offer(item)

    def delete(self, name: str, revision: int) -> None:
        pass  # a hint's key goes with the session's lease; nothing to undo

    def _offer(self, hint: PrefetchHint) -> None:
        seen = (hint.session_id, hint.epoch)
        with self._cond:
            if self._closed:
                return
            if seen in self._seen:
                return  # a re-listing repeats every live hint: not worth a count
            self._seen[seen] = None
            if len(self._seen) > _REMEMBERED:
                self._seen.popitem(last=False)
            if time.time() - hint.created > self._spec.max_age_s:
                self._counters.add(Count.PREFETCH_SKIPPED)
                return
            if len(self._queue) >= MAX_QUEUED:
                self._counters.add(Count.PREFETCH_SKIPPED)
                log.warning("kvkeep: prefetch queue full (%d); session %s not prefetched",
                            MAX_QUEUED, hint.session_id[:100])
                return
            self._queue.append(hint)
            self._cond.notify()

    # -- threads ----------------------------------------------------------------------------

    def _read_main(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                hint = self._queue.popleft()
                self._busy = True
            try:
                self._prefetch(hint)
            except KVKeepError as exc:
                self._counters.add(Count.PREFETCH_ERRORS)
                log.warning("kvkeep: prefetch of session %s failed: %s",
                            hint.session_id[:100], exc)
            except Exception:  # a bug must not end the thread: the next hint may still work
                self._counters.add(Count.PREFETCH_ERRORS)
                log.exception("kvkeep: prefetch of session %s failed", hint.session_id[:100])
            finally:
                with self._cond:
                    self._busy = False

    def _prefetch(self, hint: PrefetchHint) -> None:
        self._counters.add(Count.PREFETCH_HINTS)
        namespace = namespace_for(self._tenant, hint.salt)
        manifest = self._store.get_manifest(
            SessionKey.of(self._manifest_fp, namespace, hint.session_id))
        if manifest is None:
            self._counters.add(Count.PREFETCH_MISSING)
            return
        keys = [BlockKey.of(self._block_fp, namespace, h)
                for h in manifest.block_hashes[:self._spec.max_blocks]]
        started = time.monotonic()
        size = min(_BATCH, max(1, -(-len(keys) // _STREAMS)))
        batches = [keys[first:first + size] for first in range(0, len(keys), size)]
        pulled = 0
        for done in self._streams.map(self._pull_up, batches):
            pulled += done.pulled
            self._counters.add(Count.PREFETCH_PRESENT, done.present)
            self._counters.add(Count.PREFETCH_MISSING, done.missing + done.refused)
        self._counters.add(Count.PREFETCH_BLOCKS, pulled)
        log.info("kvkeep: prefetched %d of %d blocks of session %s in %.3fs",
                 pulled, len(keys), hint.session_id[:100], time.monotonic() - started)


    def _pull_up(self, keys: list[BlockKey]) -> PullUp:
        if self._closed:
            return PullUp(missing=len(keys))
        return self._store.pull_up(keys, deadline=time.monotonic() + _BATCH_DEADLINE_S)


def _decode(record: EtcdRecord) -> PrefetchHint:
    return PrefetchHint.from_json(record.value, record.name)
