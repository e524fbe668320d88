"""GPU memory use and temperature through NVML, for the worker agent to report.

`nvidia-ml-py` (module `pynvml`) is optional: without it, or without a GPU, `read_gpu` returns
None and the router's GPU filter passes the worker. Imported dynamically so that type checking
and CPU-only installs need neither the package nor its stubs.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from typing import Any

__all__ = ["GpuReading", "read_gpu"]

log = logging.getLogger(__name__)
_nvml: Any = None
_nvml_failed = False


@dataclass(frozen=True, slots=True)
class GpuReading:
    """The worst GPU on the host: highest memory fraction and highest temperature."""

    mem_frac: float
    temp_c: float


def _load() -> Any:
    global _nvml, _nvml_failed
    if _nvml is None and not _nvml_failed:
        try:
            module = importlib.import_module("pynvml")
            module.nvmlInit()
            _nvml = module
        except Exception as exc:  # ImportError, NVMLError (no driver), anything NVML raises
            log.debug("NVML unavailable: %s", exc)
            _nvml_failed = True
    return _nvml


def read_gpu(indices: tuple[int, ...] | None = None) -> GpuReading | None:
    nvml = _load()
    if nvml is None:
        return None
    try:
        count = int(nvml.nvmlDeviceGetCount())
        mem_frac = temp = 0.0
        for i in indices if indices is not None else range(count):
            handle = nvml.nvmlDeviceGetHandleByIndex(i)
            mem = nvml.nvmlDeviceGetMemoryInfo(handle)
            mem_frac = max(mem_frac, float(mem.used) / float(mem.total))
            temp = max(temp, float(nvml.nvmlDeviceGetTemperature(handle, 0)))  # 0: GPU die
        return GpuReading(mem_frac, temp) if count else None
    except Exception as exc:  # NVMLError subclasses are generated at runtime
        log.debug("NVML read failed: %s", exc)
        return None
