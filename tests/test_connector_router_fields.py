"""The router's fields in `kv_transfer_params`, in real engines: a hinted restore (its session
moved: `restore_reason`) waits longer for the store than a cold one, and `session_epoch` with
the request's start fences the manifest writes of a worker that lost its session, across two
engines sharing a real kvstore daemon."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from deploy.local.daemons import REPO_ROOT, DaemonProcess, running_daemon
from tests.connector_harness import (
    BLOCK_SIZE,
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

PROMPTS = random_prompts(4, [150, 170, 200, 130], seed=41)
MAX_TOKENS = 8
FAILOVER = {"session_id": "moved", "session_epoch": 2, "restore_reason": "failover",
            "previous_worker": "worker-7"}


def _restorable(prompt: list[int]) -> int:
    return (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE


def test_hinted_restores_wait_longer_than_cold_ones(tiny: TinyModel, tmp_path: Path,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    """With a store slower than `restore_deadline_ms` but faster than
    `hinted_restore_deadline_ms`: cold requests recompute, moved sessions restore."""
    from connectors.vllm.stats import Count
    from connectors.vllm.stores import acquire_store, release_store

    store_spec = {"nvme": {"path": str(tmp_path / "nvme"), "bytes": 256 << 20}}
    with open_engine(tiny.path) as llm:
        reference = generate(llm, PROMPTS, MAX_TOKENS)
    with open_engine(tiny.path, kv_transfer_config(store_spec)) as llm:
        generate(llm, PROMPTS, MAX_TOKENS)  # computes and saves every block
    config = kv_transfer_config(store_spec, restore_deadline_ms=250,
                                hinted_restore_deadline_ms=4000)
    with open_engine(tiny.path, config) as llm:
        spec = scheduler_connector(llm).config.store
        store = acquire_store(spec)
        real_get_many, real_locate = store.get_many, store.locate

        def slow_get_many(*args: Any, **kwargs: Any) -> Any:
            time.sleep(0.5)
            return real_get_many(*args, **kwargs)

        def slow_locate(*args: Any, **kwargs: Any) -> list[int]:
            # `locate`: what the scheduler half asks (each key's tier, for the decision)
            time.sleep(0.4)
            return real_locate(*args, **kwargs)

        try:
            for method, slow in (("get_many", slow_get_many), ("locate", slow_locate)):
                setattr(store, method, slow)
                try:
                    # Separate steps: loads of one step share its forward pass, and its wait.
                    cold = generate(llm, PROMPTS[:1], MAX_TOKENS)
                    llm.reset_prefix_cache()
                    moved = generate(llm, PROMPTS[:1], MAX_TOKENS, FAILOVER)
                    llm.reset_prefix_cache()
                finally:
                    delattr(store, method)
                assert cold[0].tokens == moved[0].tokens == reference[0].tokens, method
                # (vLLM's num_cached_tokens counts a failed load's blocks too: it is decided
                # when the request is scheduled, before the load runs late.)
                assert (cold[0].kv_transfer_params or {}).get("restored_tokens", 0) == 0, method
                assert moved[0].num_cached_tokens == _restorable(PROMPTS[0]), method
                assert (moved[0].kv_transfer_params or {})["restored_tokens"] == \
                    _restorable(PROMPTS[0]), method
        finally:
            release_store(spec)
        worker = worker_connector().counters()
        sched = scheduler_connector(llm).counters()
        blocks = _restorable(PROMPTS[0]) // BLOCK_SIZE
        assert worker[Count.LOAD_LATE] == blocks  # the cold load, abandoned at its deadline
        assert worker[Count.LOADED_BLOCKS] == 2 * blocks  # both moved restores
        assert sched[Count.LOOKUP_DEADLINE] == 1  # the cold lookup behind the slow store
        assert sched[Count.RESTORES_HINTED] == 2 and sched[Count.HINTED_BLOCKS_MISSING] == 0

        # A moved session whose KV is partly gone: counted, logged with where it came from,
        # and recomputed from the first missing block.
        from kvstore.keys import BlockKey, Namespace

        fingerprint = scheduler_connector(llm).fingerprint
        victim = BlockKey.of(fingerprint, Namespace("default"), block_hashes(PROMPTS[1])[2])
        store = acquire_store(spec)
        try:
            assert store.delete([victim]) == 1
        finally:
            release_store(spec)
        with caplog.at_level(logging.INFO, logger="connectors.vllm.scheduler_side"):
            (partial,) = generate(llm, PROMPTS[1:2], MAX_TOKENS, FAILOVER)
        assert partial.tokens == reference[1].tokens
        assert partial.num_cached_tokens == 2 * BLOCK_SIZE
        missing = _restorable(PROMPTS[1]) // BLOCK_SIZE - 2
        assert scheduler_connector(llm).counters()[Count.HINTED_BLOCKS_MISSING] == missing
        assert any("worker-7" in r.getMessage() and "failover" in r.getMessage()
                   for r in caplog.records)


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[DaemonProcess]:
    with running_daemon(tmp_path, "fence1") as proc:
        yield proc


_STALE_WORKER = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, {repo!r})
    from tests.connector_harness import ENGINE_DEFAULTS, kv_transfer_config, open_engine
    from tests.connector_harness import scheduler_connector
    from vllm import SamplingParams

    with open_engine({model!r}, kv_transfer_config({store!r}, checkpoint_tokens=32)) as llm:
        engine = llm.llm_engine
        engine.add_request("stale", {{"prompt_token_ids": {prompt!r}}}, SamplingParams(
            temperature=0, max_tokens={max_tokens}, ignore_eos=True,
            extra_args={{"kv_transfer_params": {params!r}}}))
        paused = False
        generated = 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                generated = len(out.outputs[0].token_ids)
            if generated >= {pause_at} and not paused:
                connector = scheduler_connector(llm)
                connector.drain_manifests()
                print(json.dumps({{"paused_at": generated, "manifests_written":
                                  connector.counters()["manifests_written"]}}), flush=True)
                sys.stdin.readline()  # the session moves to another worker meanwhile
                paused = True
        connector = scheduler_connector(llm)
        connector.drain_manifests()
        written = connector.counters()["manifests_written"]
    # Leaving the engine closed the store: its write-behind to the daemon is flushed.
    print(json.dumps({{"generated": generated, "manifests_written": written}}), flush=True)
""")


def test_stale_worker_cannot_overwrite_the_holders_manifest(tiny: TinyModel, tmp_path: Path,
                                                            daemon: DaemonProcess) -> None:
    """Worker A holds session "s" (epoch 0) and is busy decoding when the router moves the
    session to worker B (epoch 1, restore_reason failover). A keeps checkpointing; its later,
    longer manifests must not replace B's on the daemons they share."""
    from kvstore.keys import Namespace, SessionKey
    from kvstore.tiers.remote.tier import RemoteConfig, RemoteTier

    prompt = random_prompts(1, 70, seed=42)[0]
    remote = {"daemons": {daemon.node_id: daemon.address}, "timeout_ms": 2000}
    stale_store = {"host_bytes": 32 << 20, "name": "stale-worker", "remote": remote}
    script = _STALE_WORKER.format(repo=str(REPO_ROOT), model=str(tiny.path), store=stale_store,
                                  prompt=prompt, max_tokens=160, pause_at=40,
                                  params={"session_id": "s", "session_epoch": 0})
    log_path = tmp_path / "stale-worker.log"
    with open(log_path, "w") as log_file:
        child = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, stderr=log_file, text=True,
                                 env=os.environ.copy())
    try:
        assert child.stdout is not None and child.stdin is not None
        paused = _json_line(child.stdout, log_path)
        assert paused["paused_at"] >= 40, paused

        holder_store = {"host_bytes": 32 << 20, "name": "holder", "remote": remote}
        history = prompt + random_prompts(1, 40, seed=43)[0]
        with open_engine(tiny.path, kv_transfer_config(holder_store)) as llm:
            (held,) = generate(llm, [history], 8, {"session_id": "s", "session_epoch": 1,
                                                   "restore_reason": "failover",
                                                   "previous_worker": "worker-a"})
            fingerprint = scheduler_connector(llm).fingerprint
            scheduler_connector(llm).drain_manifests()
        key = SessionKey.of(fingerprint, Namespace("default"), "s")
        holder_tokens = (len(history) + 8 - 1) // BLOCK_SIZE * BLOCK_SIZE

        child.stdin.write("go\n")
        child.stdin.flush()
        done = _json_line(child.stdout, log_path)
        child.wait(timeout=120)
    finally:
        child.kill()
        child.wait(timeout=30)
    assert done["generated"] == 160
    stale_tokens = (len(prompt) + 160 - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert stale_tokens > holder_tokens  # the stale worker's last manifests were longer ...
    assert done["manifests_written"] > paused["manifests_written"]  # ... written after the move

    tier = RemoteTier.from_addresses({daemon.node_id: daemon.address},
                                     RemoteConfig(replicas=1, call_timeout=5.0))
    try:
        manifest = tier.get_manifest(key)
    finally:
        tier.close()
    assert manifest is not None
    assert manifest.token_count == holder_tokens  # ... yet the holder's manifest stands
    assert list(manifest.token_ids[:len(history)]) == history
    assert manifest.token_ids[len(history):] == held.tokens[:len(manifest.token_ids)
                                                            - len(history)]


def _json_line(stream: Any, log_path: Path) -> dict[str, Any]:
    """The next JSON line the child prints (vLLM's own output goes to its log)."""
    for line in stream:
        if line.startswith("{"):
            parsed: dict[str, Any] = json.loads(line)
            return parsed
    raise AssertionError("the stale worker exited early:\n" + log_path.read_text()[-3000:])
