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
from pathlib import Path

from connectors.vllm.config import RemoteSpec, StoreSpec
from kvstore.errors import ConfigError
from kvstore.store import StoreConfig, TieredStore
from kvstore.tiers.base import Tier

__all__ = ["acquire_store", "acquire_existing_store", "release_store", "build_tiers"]

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
            held = _Held(TieredStore(build_tiers(spec), config=StoreConfig()), 0)
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


def build_tiers(spec: StoreSpec) -> list[Tier]:
    tiers: list[Tier] = []
    try:
        if spec.host_bytes > 0:
            from kvstore.tiers.host import HostTier

            tiers.append(HostTier(spec.host_bytes))
        if spec.nvme is not None:
            from kvstore.tiers.nvme import NvmeTier

            tiers.append(NvmeTier(spec.nvme.path, spec.nvme.byte_budget,
                                  durable=spec.nvme.durable))
        if spec.remote is not None:
            tiers.append(_remote_tier(spec.remote))
    except BaseException:
        for tier in tiers:
            tier.close()
        raise
    return tiers


def _remote_tier(spec: RemoteSpec) -> Tier:
    from kvstore.tiers.remote import RemoteConfig, RemoteTier

    # Lookups sit on the scheduler's path: they get a quarter of the call budget.
    config = RemoteConfig(replicas=spec.replicas, call_timeout=spec.timeout_s,
                          lookup_timeout=max(0.05, spec.timeout_s / 4),
                          token=_read_token(spec.token_file))
    if spec.etcd is not None:
        return RemoteTier.from_etcd(spec.etcd, config, prefix=spec.prefix)
    return RemoteTier.from_addresses(dict(spec.daemons), config)


def _read_token(path: str | None) -> str | None:
    if path is None:
        return None
    try:
        lines = [line.strip() for line in Path(path).read_text().splitlines()]
    except OSError as exc:
        raise ConfigError(f"cannot read store.remote.token_file {path!r}: {exc}") from exc
    token = next((line for line in lines if line and not line.startswith("#")), None)
    if token is None:
        raise ConfigError(f"store.remote.token_file {path!r} holds no token")
    return token
