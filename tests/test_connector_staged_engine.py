"""`restore_path: "staged"` and `save_path: "staged"` in a real vLLM engine (CPU backend):
restores are token-identical to recompute and come from the staging pipelines; where vLLM's CPU
cache holds frames verbatim (the AMX layout, `cpu-amx/raw`), blocks go from the host tier's
pages straight into the cache (no staging slot, no store read that would copy them out).
Elsewhere (`cpu/tnhd`) they go through the ring of slots. Both layouts pass the same checks,
with frames signed by a tenant MAC key.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from connectors.vllm.staging.in_place import InPlaceWriter
from connectors.vllm.staging.ring_restore import RingWriter
from connectors.vllm.staging.save import RingFramer
from tests.connector_harness import (
    BLOCK_SIZE,
    Result,
    generate,
    kv_transfer_config,
    open_engine,
    random_prompts,
    scheduler_connector,
    worker_connector,
)
from tests.models import TinyModel

pytestmark = pytest.mark.slow

PROMPTS = random_prompts(4, [70, 130, 200, 330], seed=21)
MAX_TOKENS = 16


def _expected_restore(prompt: list[int]) -> int:
    return (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE


def _worker_side() -> Any:
    worker = worker_connector()._worker
    assert worker is not None
    return worker


def test_staged_paths_restore_identically(tiny: TinyModel, tmp_path: Path) -> None:
    with open_engine(tiny.path) as llm:
        reference = generate(llm, PROMPTS, MAX_TOKENS)
    store = {"host_bytes": 128 << 20, "name": "staged-test"}
    # Signed frames (a tenant MAC key): the staged framer seals them in place like any other.
    key_file = tmp_path / "tenant.mac"
    key_file.write_text("5a" * 32)
    config = kv_transfer_config(store, restore_path="staged", save_path="staged",
                                mac_key_file=str(key_file))
    with open_engine(tiny.path, config) as llm:
        first = generate(llm, PROMPTS, MAX_TOKENS)
        assert [r.tokens for r in first] == [r.tokens for r in reference]
        counters = worker_connector().counters()
        assert counters["saved_blocks"] >= sum(len(p) // BLOCK_SIZE for p in PROMPTS)
        assert counters["save_failed"] == 0
        worker = _worker_side()
        saver = worker._saver._pipeline
        assert saver is not None and isinstance(saver.framer, RingFramer)
        assert saver.framer.ring.free == saver.framer.ring.capacity

        llm.reset_prefix_cache()
        second: list[Result] = generate(llm, PROMPTS, MAX_TOKENS)
        assert [r.tokens for r in second] == [r.tokens for r in reference]
        assert [r.num_cached_tokens for r in second] == [_expected_restore(p) for p in PROMPTS]
        counters = worker_connector().counters()
        assert counters["loaded_blocks"] == sum(_expected_restore(p)
                                                for p in PROMPTS) // BLOCK_SIZE
        for reason in ("load_missing", "load_corrupt", "load_mismatch", "load_late",
                       "load_errors", "load_forged"):
            assert counters[reason] == 0, reason
        assert scheduler_connector(llm).counters()["lookup_hit_blocks"] == counters[
            "loaded_blocks"]
        pipeline = worker._loader._pipeline
        assert pipeline is not None
        steps = pipeline.times.snapshot()
        if all(blocks is not None for blocks in worker._caches.host_blocks):
            # verbatim cache: written in place, no ring at all
            assert isinstance(pipeline.writer, InPlaceWriter)
            assert "wait_checks" not in steps and "host_copy" in steps
        else:
            assert isinstance(pipeline.writer, RingWriter) and "wait_checks" in steps
            assert pipeline.writer.ring.free == pipeline.writer.ring.capacity
