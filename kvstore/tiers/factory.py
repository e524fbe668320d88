"""Tiers from configuration: a spec per tier, in order, built into `Tier` objects.

This is the one place that maps tier kinds to classes; the store itself only sees the ordered
list. A spec marked optional (by default: `hbm`, whose hardware may be absent) is skipped when its
tier cannot exist on this machine (`ConfigError` at construction), so one configuration serves
GPU and CPU-only hosts alike.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvstore.errors import ConfigError
from kvstore.tiers.base import Tier

__all__ = ["TierSpec", "build_tiers", "TIER_KINDS"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class TierSpec:
    """One tier of a store. `path` is the data directory of file-backed tiers; `optional=None`
    means "optional if the kind depends on hardware that may be missing" (hbm)."""

    kind: str
    byte_budget: int
    path: str | None = None
    name: str | None = None
    optional: bool | None = None

    @property
    def is_optional(self) -> bool:
        return self.optional if self.optional is not None else self.kind in _HARDWARE_KINDS


def _host(spec: TierSpec) -> Tier:
    from kvstore.tiers.host import HostTier

    return HostTier(spec.byte_budget, name=spec.name or "host")


def _hbm(spec: TierSpec) -> Tier:
    from kvstore.tiers.hbm import HbmTier

    return HbmTier(spec.byte_budget, name=spec.name or "hbm")


def _nvme(spec: TierSpec) -> Tier:
    from kvstore.tiers.nvme import NvmeTier

    if not spec.path:
        raise ConfigError("an nvme tier needs a path (its data directory)")
    return NvmeTier(spec.path, spec.byte_budget, name=spec.name or "nvme")


TIER_KINDS: dict[str, Callable[[TierSpec], Tier]] = {"hbm": _hbm, "host": _host, "nvme": _nvme}
_HARDWARE_KINDS = frozenset({"hbm"})


def build_tiers(specs: Sequence[TierSpec]) -> list[Tier]:
    """Construct the tiers in order, skipping optional ones this machine cannot have."""
    tiers: list[Tier] = []
    for spec in specs:
        build = TIER_KINDS.get(spec.kind)
        if build is None:
            raise ConfigError(f"unknown tier kind {spec.kind!r}; known: {sorted(TIER_KINDS)}")
        try:
            tiers.append(build(spec))
        except ConfigError as exc:
            if not spec.is_optional:
                for tier in tiers:
                    tier.close()
                raise
            log.info("skipping optional %s tier: %s", spec.kind, exc)
    if not tiers:
        raise ConfigError("no tier could be built from the configuration")
    return tiers
