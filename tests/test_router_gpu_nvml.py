"""The worker agent's GPU reading through the real NVML, on a machine with a GPU (gpu-marked).

The router-side filter is tested with a stub in test_router_pipeline; this checks that the
reading it acts on is what the driver says, and that it moves when device memory is taken.
"""

from __future__ import annotations

import pytest

from router.node import gpu


@pytest.mark.gpu
def test_nvml_reading_tracks_device_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("pynvml")
    import torch

    monkeypatch.setattr(gpu, "_nvml", None)
    monkeypatch.setattr(gpu, "_nvml_failed", False)
    before = gpu.read_gpu((torch.cuda.current_device(),))
    assert before is not None
    assert 0.0 < before.mem_frac < 1.0
    assert 10.0 < before.temp_c < 110.0  # a die temperature in Celsius, not a raw code
    free, total = torch.cuda.mem_get_info()
    take = int(min(free * 0.5, 16 << 30))
    hog = torch.empty(take, dtype=torch.uint8, device="cuda")
    hog.fill_(1)
    torch.cuda.synchronize()
    try:
        after = gpu.read_gpu((torch.cuda.current_device(),))
        assert after is not None
        assert after.mem_frac - before.mem_frac >= 0.8 * take / total
    finally:
        del hog
        torch.cuda.empty_cache()
