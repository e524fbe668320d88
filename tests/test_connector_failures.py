"""Every way a restore can fail ends in recompute: no crash, identical output, and a counter
that says why. Engines run with `kv_load_failure_policy="recompute"`."""

from __future__ import annotations

import errno
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.connector_harness import (
    BLOCK_SIZE,
    Result,
    block_files,
    block_hashes,
    generate,
    kv_transfer_config,
    open_engine,
    random_prompts,
    scheduler_connector,
    worker_connector,
)
from tests.models import TinyModel

pytestmark = pytest.mark.slow

PROMPTS = random_prompts(3, [150, 170, 200], seed=11)
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def reference(tiny: TinyModel) -> list[Result]:
    with open_engine(tiny.path) as llm:
        return generate(llm, PROMPTS, MAX_TOKENS)


def _same_tokens(results: Sequence[Result], reference: Sequence[Result]) -> None:
    assert [r.tokens for r in results] == [r.tokens for r in reference]


def _nvme(path: Path, **extra: Any) -> dict[str, Any]:
    return {"nvme": {"path": str(path), "bytes": 256 << 20, **extra}}


def _keys(llm: Any, prompt: list[int]) -> list[Any]:
    from kvstore.keys import BlockKey, Namespace

    fingerprint = scheduler_connector(llm).fingerprint
    return [BlockKey.of(fingerprint, Namespace("default"), h) for h in block_hashes(prompt)]


def test_corrupt_and_vanished_blocks_are_recomputed(tiny: TinyModel, tmp_path: Path,
                                                    reference: list[Result]) -> None:
    data = tmp_path / "nvme"
    config = kv_transfer_config(_nvme(data))
    with open_engine(tiny.path, config) as llm:
        _same_tokens(generate(llm, PROMPTS, MAX_TOKENS), reference)
    with open_engine(tiny.path, config) as llm:
        # Damage the files after the new engine indexed them: its lookups still see the blocks,
        # so the failures surface while loading, the hard case.
        corrupt = block_files(data, _keys(llm, PROMPTS[0])[1].storage_name)
        vanished = block_files(data, _keys(llm, PROMPTS[1])[2].storage_name)
        assert len(corrupt) == 1 and len(vanished) == 1
        with open(corrupt[0], "r+b") as f:
            f.seek(-100, 2)
            byte = f.read(1)
            f.seek(-100, 2)
            f.write(bytes([byte[0] ^ 0x5A]))
        vanished[0].unlink()

        results = generate(llm, PROMPTS, MAX_TOKENS)
        _same_tokens(results, reference)
        counters = worker_connector().counters()
        assert counters["load_missing"] == 2  # the store turns both into misses
        assert counters["store_corrupt"] == 1  # ... and says which one was corrupt
        # The third prompt was untouched and fully restored.
        assert results[2].num_cached_tokens == (len(PROMPTS[2]) - 1) // BLOCK_SIZE * BLOCK_SIZE
        # Each request says how much came from the store: up to its first damaged block.
        restored = [(r.kv_transfer_params or {}).get("restored_tokens", 0) for r in results]
        assert restored == [1 * BLOCK_SIZE, 2 * BLOCK_SIZE, results[2].num_cached_tokens]

        # The damaged blocks were recomputed and saved again: a third pass restores everything.
        llm.reset_prefix_cache()
        again = generate(llm, PROMPTS, MAX_TOKENS)
        _same_tokens(again, reference)
        assert [r.num_cached_tokens for r in again] == [
            (len(p) - 1) // BLOCK_SIZE * BLOCK_SIZE for p in PROMPTS]


def test_frames_of_another_configuration_are_rejected(tiny: TinyModel,
                                                      reference: list[Result]) -> None:
    """A well-formed frame under the right key, but for another layout, codec or shape."""
    from connectors.vllm.stores import acquire_store, release_store
    from kvstore.block import encode_block

    config = kv_transfer_config({"host_bytes": 64 << 20, "name": "mismatch"})
    with open_engine(tiny.path, config) as llm:
        fp = scheduler_connector(llm).fingerprint
        spec = scheduler_connector(llm).config.store
        heads, size, layers = fp.num_kv_heads, fp.head_size, fp.num_layers
        # Another layout than this engine's own (which one it uses depends on the CPU).
        other = (("cpu/tnhd", (2, BLOCK_SIZE, heads, size)) if fp.layout_id.endswith("/raw")
                 else ("cpu-amx/raw", (heads, 2 * BLOCK_SIZE, size)))
        variants = [  # (layout id, codec, per-layer shape)
            (other[0], "raw", other[1]),
            (fp.layout_id, "int8", (2, BLOCK_SIZE, heads, size)),
            (fp.layout_id, "raw", (2, BLOCK_SIZE // 2, heads, size)),
        ]
        store = acquire_store(spec)
        try:
            for prompt, (layout_id, codec, shape) in zip(PROMPTS, variants, strict=True):
                for key in _keys(llm, prompt):
                    frame = encode_block([torch.zeros(shape, dtype=torch.bfloat16)] * layers,
                                         codec=codec, key=key, token_count=BLOCK_SIZE,
                                         layout_id=layout_id, compression="none")
                    assert store.put(key, frame)
        finally:
            release_store(spec)
        _same_tokens(generate(llm, PROMPTS, MAX_TOKENS), reference)
        counters = worker_connector().counters()
        assert counters["load_mismatch"] == sum((len(p) - 1) // BLOCK_SIZE for p in PROMPTS)
        assert counters["loaded_blocks"] == 0


def test_another_fingerprint_sees_nothing(tiny: TinyModel, tmp_path: Path,
                                          reference: list[Result]) -> None:
    """Blocks saved under one weights revision are invisible under another."""
    data = tmp_path / "nvme"
    with open_engine(tiny.path, kv_transfer_config(_nvme(data), weights_revision="r1")) as llm:
        generate(llm, PROMPTS, MAX_TOKENS)
        assert worker_connector().counters()["saved_blocks"] > 0
    with open_engine(tiny.path, kv_transfer_config(_nvme(data), weights_revision="r2")) as llm:
        results = generate(llm, PROMPTS, MAX_TOKENS)
        _same_tokens(results, reference)
        assert all(r.num_cached_tokens == 0 for r in results)
        counters = scheduler_connector(llm).counters()
        assert counters["lookups"] == len(PROMPTS) and counters["lookup_hit_blocks"] == 0


def test_slow_store_misses_the_restore_deadline(tiny: TinyModel, tmp_path: Path,
                                                reference: list[Result]) -> None:
    """A lookup or a load past `restore_deadline_ms` is abandoned; vLLM computes instead."""
    from connectors.vllm.stores import acquire_store, release_store

    data = tmp_path / "nvme"
    with open_engine(tiny.path, kv_transfer_config(_nvme(data))) as llm:
        generate(llm, PROMPTS, MAX_TOKENS)
    config = kv_transfer_config(_nvme(data), restore_deadline_ms=300)
    with open_engine(tiny.path, config) as llm:
        spec = scheduler_connector(llm).config.store
        store = acquire_store(spec)
        real_get_many = store.get_many

        def slow_get_many(*args: Any, **kwargs: Any) -> Any:
            time.sleep(0.5)
            return real_get_many(*args, **kwargs)

        store.get_many = slow_get_many  # type: ignore[method-assign]
        try:
            results = generate(llm, PROMPTS, MAX_TOKENS)
        finally:
            del store.get_many
            release_store(spec)
        _same_tokens(results, reference)
        counters = worker_connector().counters()
        assert counters["load_late"] == sum((len(p) - 1) // BLOCK_SIZE for p in PROMPTS)
        assert counters["loaded_blocks"] == 0

        # The scheduler half asks `locate` (lookup's answer with the tier of each key).
        real_locate = store.locate

        def slow_locate(*args: Any, **kwargs: Any) -> list[int]:
            time.sleep(0.4)
            return real_locate(*args, **kwargs)

        store.locate = slow_locate  # type: ignore[method-assign]
        try:
            llm.reset_prefix_cache()
            results = generate(llm, PROMPTS, MAX_TOKENS)
        finally:
            del store.locate
        _same_tokens(results, reference)
        assert all(r.num_cached_tokens == 0 for r in results)
        assert scheduler_connector(llm).counters()["lookup_deadline"] == len(PROMPTS)


def test_full_disk_degrades_to_no_saves(tiny: TinyModel, tmp_path: Path,
                                        reference: list[Result]) -> None:
    from connectors.vllm.stores import acquire_store, release_store

    def enospc(fd: int, data: memoryview) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    config = kv_transfer_config(_nvme(tmp_path / "nvme"))
    with open_engine(tiny.path, config) as llm:
        spec = scheduler_connector(llm).config.store
        store = acquire_store(spec)
        try:
            (nvme,) = store.tiers
            nvme._write = enospc  # type: ignore[attr-defined]  # the tier's fault-injection hook
            results = generate(llm, PROMPTS, MAX_TOKENS)
            _same_tokens(results, reference)
            counters = worker_connector().counters()
            assert counters["save_failed"] > 0 and counters["saved_blocks"] == 0
            llm.reset_prefix_cache()
            _same_tokens(generate(llm, PROMPTS, MAX_TOKENS), reference)
        finally:
            release_store(spec)


def test_dead_remote_daemon_is_an_empty_tier(tiny: TinyModel, reference: list[Result]) -> None:
    """A remote tier whose only daemon is down: saves stay in RAM, lookups below it miss."""
    from deploy.local.ports import free_port

    port = free_port()  # nobody listens on it
    store = {"host_bytes": 64 << 20, "name": "dead-remote",
             "remote": {"daemons": {"d1": f"127.0.0.1:{port}"}, "timeout_ms": 200}}
    with open_engine(tiny.path, kv_transfer_config(store)) as llm:
        _same_tokens(generate(llm, PROMPTS, MAX_TOKENS), reference)
        llm.reset_prefix_cache()
        results = generate(llm, PROMPTS, MAX_TOKENS)  # from the host tier
        _same_tokens(results, reference)
        assert all(r.num_cached_tokens > 0 for r in results)
    with open_engine(tiny.path, kv_transfer_config(store)) as llm:  # RAM gone, remote dead
        results = generate(llm, PROMPTS, MAX_TOKENS)
        _same_tokens(results, reference)
        assert all(r.num_cached_tokens == 0 for r in results)
        counters = scheduler_connector(llm).counters()
        assert counters["lookups"] == len(PROMPTS) and counters["lookup_hit_blocks"] == 0
        assert counters["tier_remote_errors"] > 0  # the tier says why it found nothing
