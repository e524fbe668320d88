"""benchmarks.gpu's staged paths run on the host (`--device cpu`, small blocks): every figure
the issue asks of a GPU is produced, finite and positive (no timing asserts: these are not
GPU figures). The CUDA run is benchmarks/gpu_checks.sh's."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch


def test_gpu_benchmark_staged_paths_run_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    subprocess.run([sys.executable, "-m", "benchmarks.gpu", "--device", "cpu", "--quick",
                    "--json", str(out)], check=True, timeout=300)
    staged = json.loads(out.read_text())["staged"]
    expected = {
        "baseline": {"h2d_pinned_gbps", "d2h_pinned_gbps"},
        "paths": {"save_raw_gbps", "save_int8_gbps", "restore_raw_hashed_gbps",
                  "restore_raw_trusted_gbps", "restore_int8_hashed_gbps",
                  "restore_int8_trusted_gbps"},
        "ratios": {"restore_raw_vs_h2d_pinned", "restore_int8_vs_h2d_pinned",
                   "save_raw_vs_d2h_pinned", "save_int8_vs_d2h_pinned",
                   "restore_raw_trusted_vs_h2d_pinned"},
    }
    for section, names in expected.items():
        assert set(staged[section]) >= names, section
        for name in names:
            value = staged[section][name]
            assert isinstance(value, float) and math.isfinite(value) and value > 0, name
    assert set(staged["targets"]) <= set(staged["ratios"])
    assert staged["restore_2048_tokens_s"] > 0
    # a per-stage breakdown of each pipeline run
    assert "seal_and_put" in staged["stages"]["save_int8"]
    assert {"fetch", "host_copy", "verify"} <= set(staged["stages"]["restore_raw_hashed"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_gpu_benchmark_refuses_cuda_without_a_device() -> None:
    done = subprocess.run([sys.executable, "-m", "benchmarks.gpu", "--device", "cuda",
                           "--quick"], check=False, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and "needs a CUDA device" in done.stderr
