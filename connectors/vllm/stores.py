"""One `TieredStore` per store spec per process, shared by the connector's two halves.

vLLM builds the scheduler half and the worker half as two objects; with one GPU (or the CPU
backend) both live in the engine-core process. They must see the same host tier, or the
scheduler would look blocks up in an empty copy of it, so stores are kept here by spec and
reference-counted: the last release flushes and closes the store.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from connectors.vllm.config import StoreSpec
from kvstore.store import StoreConfig, TieredStore
from kvstore.tiers.factory import HostSpec, TierSpec, build_tiers

__all__ = ["acquire_store", "acquire_existing_store", "release_store", "tier_specs"]

log = logging.getLogger(__name__)

_lock = threading.Lock()


@dataclass(slots=True)
class _Held:
    store: TieredStore
    refs: int


_held: dict[StoreSpec, _Held] = {}


def acquire_store(spec: StoreSpec) -> TieredStore:
    """The process's store for `spec`, built on first use."""
    with _lock:
        held = _held.get(spec)
        if held is None:
            held = _Held(TieredStore(build_tiers(tier_specs(spec)), config=StoreConfig()), 0)
            _held[spec] = held
        held.refs += 1
        return held.store


def acquire_existing_store(spec: StoreSpec) -> TieredStore | None:
    """The process's store for `spec` if something here built it already, else None.

    The scheduler half uses this: the worker half is built first, so a store exists in this
    process exactly when the worker runs in it. Opening a second copy instead would see an
    empty host tier, and an nvme directory already locked by the worker's process.
    """
    with _lock:
        held = _held.get(spec)
        if held is None:
            return None
        held.refs += 1
        return held.store


def release_store(spec: StoreSpec, *, timeout: float = 10.0) -> None:
    """Drop one reference; the last one flushes background writes and closes the store."""
    with _lock:
        held = _held.get(spec)
        if held is None:
            return
        held.refs -= 1
        if held.refs > 0:
            return
        del _held[spec]
    held.store.close(timeout)


def tier_specs(spec: StoreSpec) -> list[TierSpec]:
    """The connector's `store` config as the tier factory's specs, fastest first."""
    specs: list[TierSpec] = []
    if spec.host_bytes > 0:
        specs.append(HostSpec(spec.host_bytes, pinned=spec.host_pinned))
    specs.extend(tier for tier in (spec.nvme, spec.remote, spec.redis) if tier is not None)
    return specs
