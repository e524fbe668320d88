"""Real vLLM engines (CPU, in-process, tiny local model) for the connector tests.

Engines run in the test process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`) and are shut down
explicitly on exit: vLLM keeps the worker-side connector in a process global that a second
engine would otherwise inherit.
"""

from __future__ import annotations

import gc
import os
import random
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

# Must be set before vllm is imported anywhere in the process.
for _name, _value in {"HF_HUB_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                      "OMP_NUM_THREADS": "1", "VLLM_NO_USAGE_STATS": "1",
                      "TOKENIZERS_PARALLELISM": "false"}.items():
    os.environ.setdefault(_name, _value)

if TYPE_CHECKING:
    from vllm import LLM

    from connectors.vllm import KVKeepConnector

BLOCK_SIZE = 32
ENGINE_DEFAULTS: dict[str, Any] = {
    "dtype": "bfloat16", "max_model_len": 1024, "block_size": BLOCK_SIZE, "enforce_eager": True,
    "seed": 0, "kv_cache_memory_bytes": 64 << 20,
}


def engine_block_shape(fingerprint: Any) -> tuple[int, ...]:
    """The per-layer block shape frames of this engine's layout hold: canonical
    `[2, N, H, D]`, or `[H, 2N, D]` for the verbatim CPU layouts (AMX, ARM, ...), which the
    engine picks by the CPU it runs on."""
    from connectors.vllm.layouts import LayoutSpec

    family = "cpu-raw" if fingerprint.layout_id.endswith("/raw") else "cpu-kt"
    return LayoutSpec(fingerprint.layout_id, family, fingerprint.num_kv_heads,
                      fingerprint.head_size, fingerprint.block_size).block_shape


# The connector's steps never wait for their saves by default (they finish in the background).
# Tests that count saves right after `generate` returns would race the saver thread, so the
# harness lets each step wait for them (bounded) unless a test sets `save_timeout_ms` itself;
# `tests/test_connector_save_stall.py` runs the default.
HARNESS_SAVE_TIMEOUT_MS = 2000  # the connector's old default: what these tests were written against


# These tests check restores: on the tiny model a prefill is so cheap that the connector's
# default restore-or-recompute decision (`restore_policy: "cost"`) could rightly recompute a
# loopback daemon's blocks under load. So the harness restores every hit unless a test sets
# `restore_policy` itself (`tests/test_connector_restore_decision.py` runs the decision).
HARNESS_RESTORE_POLICY = "always"


# These tests check which blocks come back and that they are bit-exact, not how fast: with the
# connector's 2 s default a load that a loaded test machine (`make pytest` runs more workers
# than cores) delays past it is rightly dropped and recomputed, and an exact-restore assertion
# then fails for the machine's sake. The harness waits up to a minute unless a test sets
# `restore_deadline_ms` itself (the deadline tests: test_connector_failures, _lookups,
# _router_fields, _save_stall).
HARNESS_RESTORE_DEADLINE_MS = 60_000


def kv_transfer_config(store: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"kv_connector": "KVKeepConnector", "kv_connector_module_path": "connectors.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"store": store,
                                          "save_timeout_ms": HARNESS_SAVE_TIMEOUT_MS,
                                          "restore_policy": HARNESS_RESTORE_POLICY,
                                          "restore_deadline_ms": HARNESS_RESTORE_DEADLINE_MS,
                                          **extra}}


# vLLM runs a full `gc.collect()` about eight times per engine start and stop (to measure and
# release GPU memory); in a test process holding torch's and vLLM's ~740k objects each costs
# ~0.3 s, ~2.3 s of CPU per engine (an engine's whole life here is ~0.6 s without them), and
# these tests start about a hundred. While a harness engine starts, runs and stops, a full
# collection is a young one (generations 0-1: an engine's short-lived garbage); every
# FULL_GC_EVERY engines one real full collection bounds what the skipped ones leave (measured:
# ~6 MiB and ~6k objects an engine). Engines in servers (`vllm serve`) are untouched.
FULL_GC_EVERY = 16
_engines_opened = 0


@contextmanager
def _young_collections_only() -> Iterator[None]:
    global _engines_opened
    full = gc.collect
    gc.collect = lambda generation=2: full(min(generation, 1))
    try:
        yield
    finally:
        gc.collect = full
        _engines_opened += 1
        if _engines_opened % FULL_GC_EVERY == 0:
            full()


@contextmanager
def open_engine(model: Path, kv_config: dict[str, Any] | None = None,
                **overrides: Any) -> Iterator[LLM]:
    from vllm import LLM

    from kvstore.codecs.llvmlite_compat import patch_llvmlite_for_vllm

    patch_llvmlite_for_vllm()  # numba may be loaded already (kvstore.codecs)
    kwargs = {**ENGINE_DEFAULTS, **overrides}
    if kv_config is not None:
        kwargs["kv_transfer_config"] = kv_config
    with _young_collections_only():
        try:
            llm = LLM(model=str(model), **kwargs)
        except BaseException:
            # vLLM keeps the worker's connector in a process global, created once and cleared
            # only by an engine's shutdown: an engine that fails to start after creating it
            # would hand its connector (its layout, its store) to the next engine of this
            # process.
            from vllm.distributed.kv_transfer.kv_transfer_state import (
                ensure_kv_transfer_shutdown,
            )

            ensure_kv_transfer_shutdown()
            raise
        try:
            yield llm
        finally:
            llm.llm_engine.engine_core.shutdown()
            del llm
            gc.collect()


def scheduler_connector(llm: LLM) -> KVKeepConnector:
    from connectors.vllm import KVKeepConnector

    connector = llm.llm_engine.engine_core.engine_core.scheduler.connector  # type: ignore[attr-defined]
    assert isinstance(connector, KVKeepConnector)
    return connector


def worker_connector() -> KVKeepConnector:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from connectors.vllm import KVKeepConnector

    connector = get_kv_transfer_group()
    assert isinstance(connector, KVKeepConnector)
    return connector


@dataclass(frozen=True, slots=True)
class Result:
    tokens: tuple[int, ...]
    num_cached_tokens: int
    kv_transfer_params: dict[str, Any] | None


def generate(llm: LLM, prompts: Sequence[Sequence[int]], max_tokens: int,
             params: Sequence[dict[str, Any] | None] | dict[str, Any] | None = None
             ) -> list[Result]:
    from vllm import SamplingParams

    if params is None or isinstance(params, dict):
        params = [params] * len(prompts)
    sampling = [SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                               extra_args=None if p is None else {"kv_transfer_params": p})
                for p in params]
    outputs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], sampling,
                           use_tqdm=False)
    return [Result(tuple(o.outputs[0].token_ids), int(o.num_cached_tokens or 0),
                   o.kv_transfer_params) for o in outputs]


GreedyOutputs = list[tuple[tuple[int, ...], list[dict[int, float]], int]]
"""Per prompt: greedy token ids, each step's top-5 logprobs (exact floats), cached tokens."""


def greedy_outputs(llm: LLM, prompts: Sequence[Sequence[int]], max_tokens: int
                   ) -> GreedyOutputs:
    """Greedy tokens with their top-5 logprobs and the prompt tokens vLLM found cached: what
    the exactness tests compare (two runs agree to the bit, or they do not)."""
    from vllm import SamplingParams

    sampling = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                              logprobs=5)
    outputs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], sampling,
                           use_tqdm=False)
    return [(tuple(o.outputs[0].token_ids),
             [{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs],
             int(o.num_cached_tokens or 0)) for o in outputs]


def random_prompts(count: int, length: int | Sequence[int], *, seed: int,
                   vocab: int = 1000) -> list[list[int]]:
    """Token-id prompts (ids 10..vocab, away from the special tokens)."""
    rng = random.Random(seed)
    lengths = [length] * count if isinstance(length, int) else list(length)
    return [[rng.randrange(10, vocab) for _ in range(n)] for n in lengths]


def block_hashes(token_ids: Sequence[int], block_size: int = BLOCK_SIZE) -> list[bytes]:
    """vLLM's chained hashes of the full blocks of `token_ids` (sha256, no extra keys).

    Valid once an engine has initialized vLLM's NONE_HASH in this process.
    """
    from vllm.utils.hashing import sha256
    from vllm.v1.core import kv_cache_utils

    hashes: list[bytes] = []
    parent: bytes | None = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = kv_cache_utils.hash_block_tokens(
            sha256, parent, token_ids[start:start + block_size], None)  # type: ignore[arg-type]
        hashes.append(parent)
    return hashes


def block_files(data_dir: Path, storage_name: str) -> list[Path]:
    """The nvme tier's file(s) for a block key."""
    return [p for p in data_dir.rglob(f"{storage_name}*") if p.is_file()]


def corrupt_every_frame(data_dir: Path) -> int:
    """Flip one byte inside the payload (past the header) of every nvme block file under
    `data_dir`, so every stored frame fails its checksum; returns how many files."""
    files = [p for p in data_dir.rglob("*.kvb") if p.is_file()]
    for path in files:
        raw = bytearray(path.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        path.write_bytes(bytes(raw))
    return len(files)
