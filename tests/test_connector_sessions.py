"""Sessions: manifests written from confirmed saves, decode-time checkpoints, restore hints,
and a worker killed with SIGKILL mid-generation whose session another engine continues."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from deploy.local.daemons import DaemonProcess
from tests.connector_harness import (
    BLOCK_SIZE,
    generate,
    kv_transfer_config,
    open_engine,
    random_prompts,
    scheduler_connector,
    worker_connector,
)
from tests.models import TinyModel

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]


def _manifest(llm: Any, session: str, *, wait_for_tokens: int = 0,
              timeout: float = 5.0) -> Any:
    """The session's manifest, as this engine's store sees it (polls: writes are async)."""
    from connectors.vllm.stores import acquire_store, release_store
    from kvstore.keys import Namespace, SessionKey

    connector = scheduler_connector(llm)
    key = SessionKey.of(connector.fingerprint, Namespace("default"), session)
    store = acquire_store(connector.config.store)
    try:
        deadline = time.monotonic() + timeout
        while True:
            manifest = store.get_manifest(key)
            if manifest is not None and manifest.token_count >= wait_for_tokens:
                return manifest
            if time.monotonic() > deadline:
                return manifest
            time.sleep(0.02)
    finally:
        release_store(connector.config.store)


@pytest.mark.parametrize("lookup", ["auto", "worker"])
def test_manifest_lists_saved_blocks_and_tokens(tiny: TinyModel, tmp_path: Path,
                                                lookup: str) -> None:
    from tests.connector_harness import block_hashes

    prompt = random_prompts(1, 90, seed=21)[0]
    store = {"host_bytes": 32 << 20, "nvme": {"path": str(tmp_path / "nvme"),
                                              "bytes": 64 << 20}}
    with open_engine(tiny.path, kv_transfer_config(store, lookup=lookup)) as llm:
        (result,) = generate(llm, [prompt], 70, {"session_id": "chat-1"})
        if lookup == "worker":
            # Manifests ride the next step's metadata; an in-process LLM steps only inside
            # generate() (a server's engine loop keeps stepping while they are pending).
            generate(llm, random_prompts(1, 8, seed=20), 1)
        computed = len(prompt) + 70 - 1  # the last sampled token is never fed back
        blocks = computed // BLOCK_SIZE
        manifest = _manifest(llm, "chat-1", wait_for_tokens=blocks * BLOCK_SIZE)
        everything = list(prompt) + list(result.tokens)
        assert manifest.token_count == blocks * BLOCK_SIZE
        assert list(manifest.block_hashes) == block_hashes(everything)[:blocks]
        assert len(manifest.token_ids) >= manifest.token_count
        assert list(manifest.token_ids) == everything[:len(manifest.token_ids)]
        assert result.kv_transfer_params is not None
        assert result.kv_transfer_params["session_id"] == "chat-1"
        assert result.kv_transfer_params["checkpointed_tokens"] > 0
        written = (worker_connector() if lookup == "worker" else scheduler_connector(llm))
        assert written.counters()["manifests_written"] >= 2


def test_decode_checkpoints_every_n_tokens_and_flush_at_finish(tiny: TinyModel) -> None:
    """checkpoint_tokens=96: decode saves go out three blocks at a time; a finished request's
    remaining blocks are saved on the engine's next step, before vLLM frees them."""
    prompt = random_prompts(1, 40, seed=22)[0]
    config = kv_transfer_config({"host_bytes": 32 << 20, "name": "ckpt"}, checkpoint_tokens=96)
    with open_engine(tiny.path, config) as llm:
        generate(llm, [prompt], 150, {"session_id": "ckpt-1"})
        # computed = 189 tokens -> 5 full blocks: block 0 at prefill, 1-3 at token 128, and
        # block 4 (complete at token 160) only with the flush of the finished request.
        assert _manifest(llm, "ckpt-1", wait_for_tokens=4 * BLOCK_SIZE).token_count == 128
        assert worker_connector().counters()["saved_blocks"] == 4
        generate(llm, random_prompts(1, 10, seed=23), 2)  # any step runs the pending flush
        assert _manifest(llm, "ckpt-1", wait_for_tokens=160).token_count == 160
        assert worker_connector().counters()["saved_blocks"] == 5


def test_a_one_step_request_gets_its_manifest_from_a_slow_store(
        tiny: TinyModel, daemon: DaemonProcess) -> None:
    """Saves never hold a step, so behind a slow daemon (every call 150 ms late: the saver's
    presence check crosses it) a one-token request has ended before its saves are reported.
    The scheduler half keeps it until they are, and writes its manifest from them (it used to
    forget the request one step after it finished: no manifest at all)."""
    from deploy.chaos.slow_link import SlowLink

    prompt = random_prompts(1, 4 * BLOCK_SIZE + 5, seed=24)[0]
    link = SlowLink(daemon.address, 0.15)
    try:
        config = kv_transfer_config({
            "host_bytes": 32 << 20, "name": "slow-manifest",
            "remote": {"daemons": {daemon.node_id: link.address}, "replicas": 1,
                       "timeout_ms": 5000}},
            save_timeout_ms=0)  # the default: the harness's own waits for saves
        with open_engine(tiny.path, config) as llm:
            generate(llm, [prompt], 1, {"session_id": "one-step"})
            deadline = time.monotonic() + 20.0
            # An in-process engine steps only inside generate (a server keeps stepping while
            # the connector says it has pending work).
            while time.monotonic() < deadline:
                generate(llm, random_prompts(1, 8, seed=25), 1)
                manifest = _manifest(llm, "one-step", timeout=0.2)
                if manifest is not None and manifest.token_count >= 4 * BLOCK_SIZE:
                    break
            assert manifest is not None and manifest.token_count == 4 * BLOCK_SIZE
    finally:
        link.sever()


def test_restore_hints(tiny: TinyModel) -> None:
    """`restore: none` and a partial layer range reuse nothing; all layers restore fully."""
    prompts = random_prompts(3, [100, 100, 100], seed=24)
    config = kv_transfer_config({"host_bytes": 32 << 20, "name": "hints"})
    with open_engine(tiny.path, config) as llm:
        first = generate(llm, prompts, 8)
        llm.reset_prefix_cache()
        layers = tiny.layers
        hints: list[dict[str, Any] | None] = [
            {"restore": "none"},
            {"restore": {"layers": [0, layers - 1]}},
            {"restore": {"layers": [0, layers]}},
        ]
        results = generate(llm, prompts, 8, hints)
        assert [r.tokens for r in results] == [r.tokens for r in first]
        assert [r.num_cached_tokens for r in results] == [0, 0, 96]
        counters = scheduler_connector(llm).counters()
        assert counters["restore_none"] == 1 and counters["partial_layer_unusable"] == 1
        assert worker_connector().counters()["loaded_blocks"] == 3  # nothing fetched for [0, 1)

        llm.reset_prefix_cache()
        bad = generate(llm, prompts[:1], 8, {"session_id": "no spaces allowed"})
        assert bad[0].tokens == first[0].tokens and bad[0].num_cached_tokens == 96
        assert scheduler_connector(llm).counters()["bad_params"] == 1


_CHILD = textwrap.dedent("""
    import json, sys, time
    sys.path.insert(0, {repo!r})
    from tests.connector_harness import ENGINE_DEFAULTS, kv_transfer_config
    from vllm import LLM, SamplingParams

    llm = LLM(model={model!r}, kv_transfer_config=kv_transfer_config({store!r},
              checkpoint_tokens={interval}), **{{**ENGINE_DEFAULTS, "dtype": "float32"}})
    engine = llm.llm_engine
    engine.add_request("victim", {{"prompt_token_ids": {prompt!r}}}, SamplingParams(
        temperature=0, max_tokens={max_tokens}, ignore_eos=True,
        extra_args={{"kv_transfer_params": {{"session_id": "kill-1"}}}}))
    while engine.has_unfinished_requests():
        for out in engine.step():
            print(json.dumps({{"generated": len(out.outputs[0].token_ids)}}), flush=True)
        time.sleep(0.01)  # lets the parent kill at a known token count
""")


def test_sigkill_mid_generation_then_continue_elsewhere(tiny: TinyModel, tmp_path: Path) -> None:
    prompt = random_prompts(1, 70, seed=25)[0]
    max_tokens, kill_at, interval = 300, 150, 32
    store = {"nvme": {"path": str(tmp_path / "nvme"), "bytes": 64 << 20}}
    script = _CHILD.format(repo=str(REPO), model=str(tiny.path), store=store, interval=interval,
                           prompt=prompt, max_tokens=max_tokens)
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True, env=os.environ.copy())
    generated = 0
    try:
        assert child.stdout is not None
        for line in child.stdout:
            if line.startswith("{"):
                generated = json.loads(line)["generated"]
                if generated >= kill_at:
                    child.send_signal(signal.SIGKILL)
                    break
    finally:
        child.kill()
        child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL
    assert kill_at <= generated < max_tokens

    # float32: a resumed session computes its lost tail by prefill where the unbroken run used
    # decode steps; in bf16 those differ in the last bits and flip near-tied tokens of a random
    # model hundreds of tokens later. In fp32 the comparison is about the KV, not the rounding.
    with open_engine(tiny.path, kv_transfer_config(store, checkpoint_tokens=interval),
                     dtype="float32") as llm:
        manifest = _manifest(llm, "kill-1")
        assert manifest is not None
        history = list(manifest.token_ids)
        remaining = max_tokens - (len(history) - len(prompt))
        (resumed,) = generate(llm, [history], remaining, {"session_id": "kill-1"})
        # At most one checkpoint interval (plus the block in progress) was lost.
        total = len(prompt) + generated
        assert resumed.num_cached_tokens >= total - interval - BLOCK_SIZE
        assert resumed.num_cached_tokens == manifest.token_count
        # And restored KV acts like recomputed KV.
        llm.reset_prefix_cache()
        (recomputed,) = generate(llm, [history], remaining,
                                 {"session_id": "kill-1-recompute", "restore": "none"})
        assert recomputed.num_cached_tokens == 0
        assert list(resumed.tokens) == list(recomputed.tokens)
        # The unbroken run, last (its own saves must not be what the resumed session read), in
        # this engine rather than one of its own (an engine start is most of this test's time).
        llm.reset_prefix_cache()
        (reference,) = generate(llm, [prompt], max_tokens,
                                {"session_id": "kill-1-reference", "restore": "none"})
        assert reference.num_cached_tokens == 0
    # The router would resend exactly the history: the session's tokens as the manifest knows
    # them, those of the unbroken run.
    assert history == list(prompt) + list(reference.tokens[:len(history) - len(prompt)])
    assert list(history) + list(resumed.tokens) == list(prompt) + list(reference.tokens)
