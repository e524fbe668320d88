"""The connector in a real vLLM engine: restore is token-identical to recompute, and is used.

Each test compares greedy outputs against an engine without the connector, on the tiny local
Llama (tests/models.py). The negative control stores well-formed, checksummed blocks of random
KV under the right keys: if the output did not change, the restored KV would not be in use.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deploy.local.daemons import DaemonProcess
from tests.connector_harness import (
    BLOCK_SIZE,
    Result,
    block_hashes,
    engine_block_shape,
    generate,
    kv_transfer_config,
    open_engine,
    random_prompts,
    scheduler_connector,
    worker_connector,
)
from tests.models import TinyModel

pytestmark = pytest.mark.slow

PROMPTS = random_prompts(5, [70, 100, 150, 200, 320], seed=1)
CONTROL = random_prompts(2, [130, 180], seed=2)
MAX_TOKENS = 24


def expected_restore(prompt: list[int]) -> int:
    """Tokens a full restore supplies: every full block but the one holding the last token."""
    return (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE


@pytest.fixture(scope="module")
def reference(tiny: TinyModel) -> dict[tuple[int, ...], Result]:
    with open_engine(tiny.path) as llm:
        results = generate(llm, PROMPTS + CONTROL, MAX_TOKENS)
    return {tuple(p): r for p, r in zip(PROMPTS + CONTROL, results, strict=True)}


def _check_identical(results: list[Result], prompts: list[list[int]],
                     reference: dict[tuple[int, ...], Result]) -> None:
    for prompt, result in zip(prompts, results, strict=True):
        assert result.tokens == reference[tuple(prompt)].tokens


@pytest.mark.parametrize("lookup", ["auto", "worker"])
def test_restore_after_prefix_cache_reset(tiny: TinyModel, lookup: str,
                                          reference: dict[tuple[int, ...], Result]) -> None:
    """`lookup: worker` is how a multiprocess engine looks blocks up (the store lives in the
    worker's process): forced here in-process to run the same checks on that path."""
    store = {"host_bytes": 128 << 20, "name": "reset-test"}
    with open_engine(tiny.path, kv_transfer_config(store, lookup=lookup)) as llm:
        first = generate(llm, PROMPTS, MAX_TOKENS)
        _check_identical(first, PROMPTS, reference)
        assert all(r.num_cached_tokens == 0 for r in first)
        saved = worker_connector().counters()["saved_blocks"]
        assert saved >= sum(len(p) // BLOCK_SIZE for p in PROMPTS)

        llm.reset_prefix_cache()
        second = generate(llm, PROMPTS, MAX_TOKENS)
        _check_identical(second, PROMPTS, reference)
        assert [r.num_cached_tokens for r in second] == [expected_restore(p) for p in PROMPTS]
        assert all(r.kv_transfer_params is None for r in first)  # nothing restored, no session
        assert [(r.kv_transfer_params or {}).get("restored_tokens") for r in second] == [
            expected_restore(p) for p in PROMPTS]

        worker = worker_connector().counters()
        assert worker["loaded_blocks"] == sum(expected_restore(p) for p in PROMPTS) // BLOCK_SIZE
        for reason in ("load_missing", "load_corrupt", "load_mismatch", "load_late",
                       "load_errors"):
            assert worker[reason] == 0, reason
        sched = scheduler_connector(llm).counters()
        assert sched["lookup_hit_blocks"] == worker["loaded_blocks"]


def test_fresh_engine_restores_from_shared_nvme(tiny: TinyModel, tmp_path: Path,
                                                reference: dict[tuple[int, ...], Result]
                                                ) -> None:
    """Failover: a second engine, started after the first is gone, restores from disk."""
    store = {"host_bytes": 64 << 20, "nvme": {"path": str(tmp_path / "nvme"),
                                              "bytes": 256 << 20}}
    with open_engine(tiny.path, kv_transfer_config(store)) as llm:
        _check_identical(generate(llm, PROMPTS, MAX_TOKENS), PROMPTS, reference)
    # The first engine's store was flushed and closed with it: the new one starts empty in RAM.
    with open_engine(tiny.path, kv_transfer_config(store)) as llm:
        results = generate(llm, PROMPTS, MAX_TOKENS)
        _check_identical(results, PROMPTS, reference)
        assert [r.num_cached_tokens for r in results] == [expected_restore(p) for p in PROMPTS]
        assert worker_connector().counters()["loaded_blocks"] == sum(
            expected_restore(p) for p in PROMPTS) // BLOCK_SIZE


def test_negative_control_random_kv_changes_output(
        tiny: TinyModel, reference: dict[tuple[int, ...], Result]) -> None:
    """Valid frames of random KV under the prompt's keys: restored, used, output changes."""
    from connectors.vllm.stores import acquire_store, release_store
    from kvstore.block import encode_block
    from kvstore.keys import BlockKey, Namespace

    store_cfg = {"host_bytes": 64 << 20, "name": "negative-control"}
    config = kv_transfer_config(store_cfg)
    with open_engine(tiny.path, config) as llm:
        connector = scheduler_connector(llm)
        fingerprint = connector.fingerprint
        spec = connector.config.store
        shape = engine_block_shape(fingerprint)
        gen = torch.Generator().manual_seed(7)
        store = acquire_store(spec)
        try:
            for prompt in CONTROL:
                for block_hash in block_hashes(prompt):
                    key = BlockKey.of(fingerprint, Namespace("default"), block_hash)
                    layers = [torch.randn(shape, generator=gen).to(torch.bfloat16)
                              for _ in range(fingerprint.num_layers)]
                    frame = encode_block(layers, codec="raw", key=key, token_count=BLOCK_SIZE,
                                         layout_id=fingerprint.layout_id, compression="none")
                    assert store.put(key, frame)
        finally:
            release_store(spec)
        results = generate(llm, CONTROL, MAX_TOKENS)
        assert [r.num_cached_tokens for r in results] == [expected_restore(p) for p in CONTROL]
        for prompt, result in zip(CONTROL, results, strict=True):
            assert result.tokens != reference[tuple(prompt)].tokens
        assert worker_connector().counters()["loaded_blocks"] == sum(
            expected_restore(p) for p in CONTROL) // BLOCK_SIZE


def test_async_loading_restores_identically(tiny: TinyModel, reference: dict[tuple[int, ...],
                                                                              Result]) -> None:
    """`load_mode: async`: vLLM parks the request while the worker loads in the background,
    then schedules it with the restored prefix; a corrupt block still ends in recompute."""
    from connectors.vllm.stores import acquire_store, release_store
    from kvstore.keys import BlockKey, Namespace

    store = {"host_bytes": 64 << 20, "name": "async-test"}
    with open_engine(tiny.path, kv_transfer_config(store, load_mode="async")) as llm:
        _check_identical(generate(llm, PROMPTS, MAX_TOKENS), PROMPTS, reference)
        llm.reset_prefix_cache()
        results = generate(llm, PROMPTS, MAX_TOKENS)
        _check_identical(results, PROMPTS, reference)
        assert [r.num_cached_tokens for r in results] == [expected_restore(p) for p in PROMPTS]

        # Delete one block behind the scheduler's back: lookups may still be answered from a
        # cache, the load fails, and vLLM recomputes from that block on.
        connector = scheduler_connector(llm)
        spec = connector.config.store
        victim = BlockKey.of(connector.fingerprint, Namespace("default"),
                             block_hashes(PROMPTS[4])[3])
        shared = acquire_store(spec)
        try:
            shared.delete([victim])
            # The scheduler half asks `locate` (which tier holds each key: the restore-or-
            # recompute decision prices it); claim every key is in the first tier.
            shared.locate = lambda keys, **kw: [0] * len(keys)  # type: ignore[method-assign]
            llm.reset_prefix_cache()
            results = generate(llm, PROMPTS[4:], MAX_TOKENS)
        finally:
            del shared.locate
            release_store(spec)
        _check_identical(results, PROMPTS[4:], reference)
        assert worker_connector().counters()["load_missing"] == 1


def test_auto_load_mode_restores_from_a_daemon_identically(
        tiny: TinyModel, daemon: DaemonProcess,
        reference: dict[tuple[int, ...], Result]) -> None:
    """`load_mode: auto` (the default): blocks on a daemon load asynchronously (the request
    parked, the batch going on), blocks in host RAM inside the forward pass; both restore the
    whole stored prefix with the recomputed answers."""
    remote = {"daemons": {daemon.node_id: daemon.address}, "replicas": 1, "timeout_ms": 5000}
    with open_engine(tiny.path, kv_transfer_config(
            {"remote": remote, "name": "auto-save"})) as llm:
        _check_identical(generate(llm, PROMPTS, MAX_TOKENS), PROMPTS, reference)
    # A fresh engine, host RAM empty: every hit is on the daemon.
    with open_engine(tiny.path, kv_transfer_config(
            {"host_bytes": 64 << 20, "remote": remote, "name": "auto-load"})) as llm:
        results = generate(llm, PROMPTS, MAX_TOKENS)
        _check_identical(results, PROMPTS, reference)
        assert [r.num_cached_tokens for r in results] == [expected_restore(p) for p in PROMPTS]
        loaded = worker_connector().counters()["loaded_blocks"]
        assert loaded == sum(expected_restore(p) for p in PROMPTS) // BLOCK_SIZE
        restoring = sum(1 for p in PROMPTS if expected_restore(p))
        assert scheduler_connector(llm).counters()["async_loads"] == restoring
        # Now promoted into host RAM: the same prompts load in the forward pass.
        llm.reset_prefix_cache()
        results = generate(llm, PROMPTS, MAX_TOKENS)
        _check_identical(results, PROMPTS, reference)
        assert worker_connector().counters()["loaded_blocks"] == 2 * loaded
        assert scheduler_connector(llm).counters()["async_loads"] == restoring  # none more


_MP_CHILD = """
import json, os, sys
sys.path.insert(0, {repo!r})
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
from tests.connector_harness import generate, kv_transfer_config, open_engine

if __name__ == "__main__":
    with open_engine({model!r}, kv_transfer_config({store!r})) as llm:
        restored = generate(llm, {prompts!r}, {max_tokens})  # saved by another engine
        generate(llm, {fresh!r}, {max_tokens})  # saved by this one ...
        llm.reset_prefix_cache()
        again = generate(llm, {fresh!r}, {max_tokens})  # ... and restored
    print("RESULT " + json.dumps([[[list(r.tokens), r.num_cached_tokens] for r in rs]
                                  for rs in (restored, again)]), flush=True)
"""


def test_multiprocess_engine_fails_over(tiny: TinyModel, tmp_path: Path,
                                        reference: dict[tuple[int, ...], Result]) -> None:
    """`vllm serve`'s layout: scheduler and worker in separate processes. The worker owns the
    store; the scheduler's lookups go through the step metadata (`Probe`)."""
    import json
    import os
    import subprocess
    import sys

    store = {"host_bytes": 32 << 20, "nvme": {"path": str(tmp_path / "nvme"),
                                              "bytes": 64 << 20}}
    with open_engine(tiny.path, kv_transfer_config(store)) as llm:
        generate(llm, PROMPTS, MAX_TOKENS)
    script = tmp_path / "child.py"
    script.write_text(_MP_CHILD.format(repo=str(Path(__file__).resolve().parents[1]),
                                       store=store, model=str(tiny.path), prompts=PROMPTS,
                                       fresh=CONTROL, max_tokens=MAX_TOKENS))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=240, env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"},
                          check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    restored, again = json.loads(lines[-1].removeprefix("RESULT "))
    for prompts, results in ((PROMPTS, restored), (CONTROL, again)):
        for prompt, (tokens, cached) in zip(prompts, results, strict=True):
            assert tuple(tokens) == reference[tuple(prompt)].tokens
            assert cached == expected_restore(prompt)
