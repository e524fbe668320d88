"""Filters: which workers may take a request (hard), and which should take new sessions (soft)."""

from router.filters.base import Filter
from router.filters.health import ExcludeFilter, ModelFilter, UsableFilter
from router.filters.load import (
    BoundedLoadFilter,
    GpuFilter,
    KVThresholdFilter,
    QueueThresholdFilter,
    SaturationFilter,
)

__all__ = ["Filter", "UsableFilter", "ModelFilter", "ExcludeFilter", "SaturationFilter",
           "KVThresholdFilter", "GpuFilter", "QueueThresholdFilter", "BoundedLoadFilter"]
