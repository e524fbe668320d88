"""The tiered block store: `TieredStore` and what comes with it.

- `facade.py`: `TieredStore` (get/put/lookup/manifests/lifecycle; the rules are in its docstring)
- `write_behind.py` + `jobs.py`: the background copies between tiers, as typed jobs
- `replicated.py`: puts that wait until several nodes of a replicating tier hold each block
- `tier_calls.py`: each call into a tier timed and counted, and the one verifying read
- `aio.py`: `AsyncTieredStore`, the same calls for asyncio code
- `config.py`, `stats.py`: `StoreConfig`, and `StoreStats` (a view of the Prometheus counters)

The capability protocols tiers may implement live with the tier interface, in
`kvstore.tiers.capabilities`; they are re-exported here for callers of the old module.
"""

from kvstore.frame import FrameBytes
from kvstore.store.aio import AsyncTieredStore
from kvstore.store.config import StoreConfig
from kvstore.store.facade import PullUp, TieredStore
from kvstore.store.stats import StoreStats
from kvstore.tiers.capabilities import SupportsBorrow, SupportsPutMany, SupportsReserve

__all__ = ["TieredStore", "PullUp", "AsyncTieredStore", "StoreConfig", "StoreStats", "FrameBytes",
           "SupportsPutMany", "SupportsBorrow", "SupportsReserve"]
