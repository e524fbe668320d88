"""Hybrid attention with vLLM's hybrid KV cache manager (HMA) on: a full-attention group and a
sliding-window group, each with its own block table (`connectors/vllm/groups.py`).

Real engines with HMA on (`tests/test_connector_sliding_window.py`) prove whole restores; the
cases they do not reach on demand (blocks a window freed, one group's block corrupt, decode
checkpoints against the window) are driven here, as vLLM's own scheduler tests do: vLLM's real
`Scheduler` and `KVCacheManager` in-process over a hybrid `KVCacheConfig`, with the real
connector on both sides (scheduler half inside the scheduler, worker half bound to CPU paged
tensors) and a real store on disk. What stands in
for the model is the forward pass: each step writes, for every block it completes, a block of
KV that is a function of the layer and the block's chained hash (so a block restored into the
wrong group, position or layer is caught), and samples a fixed token.

Proven here, save in one engine and restore in a fresh one (its store opened anew from disk):
- each group's blocks are restored bit-exact into that group's block ids;
- the sliding-window group loads only the blocks vLLM kept inside the window of the restored
  prefix (null entries are neither saved nor loaded);
- a corrupted block of either group fails the request's load as a whole (`failed_recving`)
  and vLLM recomputes it from the start: no wrong KV is attended to;
- groups the store cannot keep (SSM/Mamba state, other block sizes) are refused at start-up.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from deploy.local.probes import wait_until
from tests.connector_harness import kv_transfer_config

BS = 16
WINDOW = 40  # tokens: a sliding layer attends to at most 40 positions (under 3 blocks)
LAYERS = 4
NUM_BLOCKS = 96
MAX_TOKENS = 3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from deploy.local.model import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("hybrid") / "llama4", layers=LAYERS).path


LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
FULL_LAYERS = LAYER_NAMES[0::2]
SLIDING_LAYERS = LAYER_NAMES[1::2]


def _vllm_config(model_dir: Path, store_dir: Path, **extra: Any) -> Any:
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs

    store = {"host_bytes": 16 << 20, "nvme": {"path": str(store_dir), "bytes": 64 << 20}}
    config = EngineArgs(model=str(model_dir), block_size=BS, dtype="bfloat16",
                        max_model_len=512, enforce_eager=True, seed=0,
                        kv_transfer_config=KVTransferConfig(**kv_transfer_config(store,
                                                                                 **extra))
                        ).create_engine_config()
    # What vLLM decides on a GPU for a connector that subclasses SupportsHMA.
    config.scheduler_config.disable_hybrid_kv_cache_manager = False
    config.cache_config.num_gpu_blocks = NUM_BLOCKS
    return config


def _kv_cache_config(vllm_config: Any, *, sliding: Any = None) -> Any:
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        SlidingWindowSpec,
    )

    model = vllm_config.model_config
    shape = {"block_size": BS, "num_kv_heads": model.get_num_kv_heads(vllm_config.parallel_config),
             "head_size": model.get_head_size(), "dtype": torch.bfloat16}
    second = sliding if sliding is not None else SlidingWindowSpec(**shape,
                                                                   sliding_window=WINDOW)
    return KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(FULL_LAYERS, FullAttentionSpec(**shape)),
        KVCacheGroupSpec(SLIDING_LAYERS, second)])


def _block_kv(shape: tuple[int, ...], layer: int, block_hash: bytes) -> torch.Tensor:
    """The KV the stand-in forward pass writes for one block of one layer."""
    seed = int.from_bytes(bytes(block_hash)[:7], "little") ^ (layer << 56)
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).to(torch.bfloat16)


@dataclass
class Engine:
    scheduler: Any
    worker: Any
    caches: dict[str, torch.Tensor]
    hasher: Any
    loads: list[Any] = field(default_factory=list)
    """Every LoadSpec the scheduler sent."""
    failed_recving: set[str] = field(default_factory=set)

    def add(self, req_id: str, prompt: list[int], max_tokens: int = MAX_TOKENS) -> Any:
        from vllm import SamplingParams
        from vllm.v1.request import Request

        request = Request(req_id, prompt, SamplingParams(max_tokens=max_tokens,
                                                         ignore_eos=True),
                          None, block_hasher=self.hasher)
        self.scheduler.add_request(request)
        return request

    def step(self) -> Any:
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        out = self.scheduler.schedule()
        meta = out.kv_connector_metadata
        self.loads.extend(meta.loads)
        manager = self.scheduler.kv_cache_manager
        for spec in meta.saves:  # only blocks the request holds now, never a freed one
            run = spec.run
            held = manager.get_block_ids(run.req_id)[run.group]
            assert tuple(held[run.first:run.first + len(run)]) == run.block_ids, run
            assert 0 not in run.block_ids
        worker = self.worker
        worker.bind_connector_metadata(meta)
        worker.start_load_kv(None)
        for index, name in enumerate(LAYER_NAMES):
            worker.wait_for_layer_load(name)
            self._forward(out, name, index)
            worker.save_kv_layer(name, self.caches[name], None)
        worker.wait_for_save()
        results = worker.get_transfer_results(set(out.finished_req_ids))
        self.failed_recving |= results.failed_recving
        kv_out = KVConnectorOutput(
            finished_sending=results.finished_sending or None,
            finished_recving=results.finished_recving or None,
            failed_recving=results.failed_recving,
            invalid_block_ids=worker.get_block_ids_with_load_errors(),
            kv_connector_worker_meta=worker.build_connector_worker_meta())
        worker.clear_connector_metadata()
        req_ids = list(out.num_scheduled_tokens)
        sampled = []
        for req_id in req_ids:
            request = self.scheduler.requests[req_id]
            done = request.num_computed_tokens  # schedule() counted the step's tokens in
            sampled.append([7] if done >= request.num_tokens else [])
        self.scheduler.update_from_output(out, ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled, kv_connector_output=kv_out))
        return out

    def _forward(self, out: Any, name: str, layer: int) -> None:
        """Write the KV of every block this step completes, in every group holding the layer."""
        group = 0 if name in FULL_LAYERS else 1
        cache = self.caches[name]
        for req_id, count in out.num_scheduled_tokens.items():
            request = self.scheduler.requests[req_id]
            start = request.num_computed_tokens - count  # schedule() counted them in already
            ids = self.scheduler.kv_cache_manager.get_block_ids(req_id)[group]
            for j in range(start // BS, (start + count) // BS):
                if j < len(request.block_hashes) and ids[j] != 0:
                    cache[ids[j]] = _block_kv(tuple(cache.shape[1:]), layer,
                                              request.block_hashes[j])

    def run(self, *req_ids: str, limit: int = 200) -> None:
        for _ in range(limit):
            if all(r not in self.scheduler.requests for r in req_ids) and \
                    not self.scheduler.has_unfinished_requests():
                return
            self.step()
        raise AssertionError("requests did not finish")


@contextmanager
def engine(model_dir: Path, store_dir: Path, **extra: Any) -> Iterator[Engine]:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    from connectors.vllm import KVKeepConnector
    from connectors.vllm.layouts import LayoutSpec

    config = _vllm_config(model_dir, store_dir, **extra)
    kv_config = _kv_cache_config(config)
    # The worker half first: the scheduler half then shares its store (in-process lookups).
    worker = KVKeepConnector(config, KVConnectorRole.WORKER, kv_config)
    layout: LayoutSpec = worker._layout
    shape = ((NUM_BLOCKS, layout.num_kv_heads, BS, 2 * layout.head_size)
             if layout.family in ("cpu-kt", "cpu-raw") else None)
    assert shape is not None, layout
    caches = {name: torch.zeros(shape, dtype=torch.bfloat16) for name in LAYER_NAMES}
    worker.register_kv_caches(caches)
    scheduler = Scheduler(config, kv_config, StructuredOutputManager(config), block_size=BS)
    hash_fn = get_hash_fn_by_name(config.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    try:
        yield Engine(scheduler, worker, caches, get_request_block_hasher(BS, hash_fn))
    finally:
        scheduler.shutdown()
        worker.shutdown()


PROMPT = list(range(100, 100 + 5 * BS + 5))  # 5 full blocks and a partial one


def _saved(model_dir: Path, store_dir: Path) -> None:
    with engine(model_dir, store_dir) as first:
        first.add("a", PROMPT)
        first.run("a")
        first.scheduler.connector._scheduler.drain_manifests()


def _restored_blocks(eng: Engine, request: Any) -> list[tuple[int, int, int]]:
    """(group, block index, block id) of every block the engine's loads wrote for `request`."""
    return [(load.run.group, load.run.first + i, block_id)
            for load in eng.loads if load.run.req_id == request.request_id
            for i, block_id in enumerate(load.run.block_ids)]


def test_each_group_restores_its_own_blocks_and_the_window_only(model_dir: Path,
                                                                 tmp_path: Path) -> None:
    store = tmp_path / "nvme"
    _saved(model_dir, store)
    # A deadline no loaded machine reaches: this test is about which blocks each group gets
    # back. With the harness's 2 s, a suite run with three workers on two cores once had a load
    # come in late, be dropped and recomputed (as it should), and the bit-exact check below
    # then read a block the load never filled.
    with engine(model_dir, store, restore_deadline_ms=120_000) as second:
        request = second.add("b", PROMPT)
        for _ in range(50):  # until its (asynchronous) load is in and a token sampled
            second.step()
            if request.num_output_tokens:
                break
        loaded = _restored_blocks(second, request)
        problems = {k: v for k, v in second.worker.counters().as_dict().items()
                    if k.startswith("load_") and v}
        assert not problems, problems  # every load in: late, missing or corrupt would show
        # Every full block of the prompt comes back in the full-attention group; the sliding
        # group gets only the blocks inside the window of the restored prefix (5 blocks = 80
        # tokens; a 40-token window keeps blocks 2-4), the rest are vLLM's null block.
        restored = (len(PROMPT) - 1) // BS
        assert sorted((i for g, i, _ in loaded if g == 0)) == list(range(restored))
        first_kept = max(0, restored * BS - WINDOW + 1) // BS
        assert first_kept == 2
        assert sorted((i for g, i, _ in loaded if g == 1)) == list(range(first_kept, restored))
        sliding_ids = second.scheduler.kv_cache_manager.get_block_ids("b")[1]
        assert all(sliding_ids[i] == 0 for i in range(first_kept))
        assert not second.failed_recving
        # Bit-exact, in each group's own block ids and layers.
        for group, index, block_id in loaded:
            names = FULL_LAYERS if group == 0 else SLIDING_LAYERS
            for name in names:
                layer = LAYER_NAMES.index(name)
                cache = second.caches[name]
                expected = _block_kv(tuple(cache.shape[1:]), layer,
                                     request.block_hashes[index])
                assert torch.equal(cache[block_id], expected), (group, index, name)
        counters = second.worker.counters()
        assert counters["loaded_blocks"] == len(loaded)
        second.run("b")


def test_a_corrupt_block_of_one_group_fails_the_request_and_vllm_recomputes(
        model_dir: Path, tmp_path: Path) -> None:
    """One sliding-window block inside the window is damaged on disk: the full-attention
    group's part loads, the sliding group's fails its checksum, so the request's load fails
    as a whole and vLLM computes it from the start (the connector offers it no second
    restore); nothing of the damaged block is attended to."""
    from kvstore.keys import BlockKey, Namespace

    store = tmp_path / "nvme"
    _saved(model_dir, store)
    with engine(model_dir, store) as second:
        sliding_fp = second.worker._worker._sides[1]._fp
        request = second.add("b", PROMPT)
        hasher_hashes = request.block_hashes
        key = BlockKey.of(sliding_fp, Namespace("default"), bytes(hasher_hashes[3]))
        (path,) = store.rglob(f"{key.digest.hex()}.kvb")
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x5A
        damaged = bytes(data)
        path.write_bytes(damaged)
        second.run("b")
        assert second.failed_recving == {"b"}
        assert [load.run.group for load in second.loads] == [0, 1]  # one attempt only
        counters = second.worker.counters()
        assert counters["store_corrupt"] == 1
        assert request.num_output_tokens == MAX_TOKENS
        # The store drops the damaged copy on its reading thread, after the load's failure is
        # reported: wait for it rather than race it. The recompute may then save the block
        # again (the saver asks the store, which no longer has it), so the path may hold a
        # fresh copy: what must be gone is the damaged one.
        wait_until(lambda: _content(path) != damaged, timeout=10,
                   what="the damaged copy's deletion")
    from kvstore.tiers.nvme.tier import NvmeTier
    reopened = NvmeTier(store, 256 << 20)
    try:
        read = reopened.get(key)  # CorruptBlock here would be the damaged copy still served
        assert read is None or read.verified_for(key.digest).payload
    finally:
        reopened.close()


def _content(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None


def test_blocks_completed_in_decode_are_saved_before_the_window_frees_them(
        model_dir: Path, tmp_path: Path) -> None:
    """A long answer completes blocks one by one; the sliding group frees each once it is
    W tokens behind. The checkpoint interval is capped below the window, so every completed
    block of both groups reaches the store (a later restore of any prefix finds them), even
    where the operator asked for checkpoints every 8 blocks."""
    from kvstore.keys import BlockKey, Namespace

    with engine(model_dir, tmp_path / "nvme", checkpoint_tokens=8 * BS) as eng:
        request = eng.add("long", list(range(300, 320)), max_tokens=8 * BS)
        hashes = request.block_hashes  # grows with the answer
        eng.run("long")
        eng.worker._worker._sides[0]._store.flush()
        complete = (len(request.all_token_ids) - 1) // BS
        assert complete >= 8
        for side in eng.worker._worker._sides:
            keys = [BlockKey.of(side._fp, Namespace("default"), bytes(h))
                    for h in hashes[:complete]]
            assert all(tier >= 0 for tier in side._store.locate(keys)), side._fp.layout_id


def test_groups_the_store_cannot_keep_are_refused_at_start_up(model_dir: Path,
                                                              tmp_path: Path) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    from connectors.vllm import KVKeepConnector
    from kvstore.errors import ConfigError

    config = _vllm_config(model_dir, tmp_path / "nvme")
    model = config.model_config
    heads = model.get_num_kv_heads(config.parallel_config)
    mamba = MambaSpec(block_size=BS, shapes=((4, 8),), dtypes=(torch.bfloat16,))
    with pytest.raises(ConfigError, match="SSM/Mamba"):
        KVKeepConnector(config, KVConnectorRole.SCHEDULER, _kv_cache_config(config,
                                                                             sliding=mamba))
    other_size = FullAttentionSpec(block_size=2 * BS, num_kv_heads=heads,
                                   head_size=model.get_head_size(), dtype=torch.bfloat16)
    with pytest.raises(ConfigError, match="blocks of 32 tokens"):
        KVKeepConnector(config, KVConnectorRole.SCHEDULER,
                        _kv_cache_config(config, sliding=other_size))


def test_each_group_has_its_own_fingerprint_and_one_group_keeps_the_model_s(
        model_dir: Path, tmp_path: Path) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from connectors.vllm import KVKeepConnector

    config = _vllm_config(model_dir, tmp_path / "nvme")
    hybrid = KVKeepConnector(config, KVConnectorRole.SCHEDULER, _kv_cache_config(config))
    single = KVKeepConnector(config, KVConnectorRole.SCHEDULER, None)  # type: ignore[arg-type]
    try:
        fps = hybrid._scheduler._group_fps
        assert len({fp.digest for fp in fps}) == 2
        assert all(fp.digest != single.fingerprint.digest for fp in fps)
        assert [fp.num_layers for fp in fps] == [2, 2]
        assert single._scheduler._group_fps == (single.fingerprint,)
    finally:
        hybrid.shutdown()
        single.shutdown()


os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
