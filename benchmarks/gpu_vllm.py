"""Restore vs recompute TTFT with the connector inside a GPU build of vLLM (issue 9).

    python -m benchmarks.gpu_vllm --json OUT.json [--contexts 2048 8192] [--paths auto staged]

A Llama-3-8B-shaped model (32 layers, hidden 4096, 32 heads, 8 KV heads, head 128, vocab
128256) with random weights (`load_format="dummy"`: nothing downloaded) serves token-id
prompts. One engine per restore path (`restore_path` "auto", "staged"; the staged one with a
page-locked host tier, `store.host_pinned`), each measuring, per context:

- recompute_ttft_s: a fresh prompt's time to first token (nothing stored yet; the connector
  saves it meanwhile, as in production);
- restore_ttft_s: the last such prompt again after vLLM's prefix cache was reset, so its KV
  comes from the host tier through the connector;
- outputs_identical: the 16 greedy tokens after a restore equal those after recompute.

Where vLLM is not installed or is not a CUDA build, it writes `{"skipped": why}` and exits 0
(benchmarks/gpu_checks.sh runs it on any device machine).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import restore as cpu_bench  # its engine helpers; sets vLLM's env first
from benchmarks.cli import as_json, run_benchmark
from benchmarks.progress import progress

__all__ = ["main"]

MODEL = {"vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
         "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
         "head_dim": 128}


def _why_not() -> str | None:
    try:
        import vllm  # noqa: F401
        from vllm.platforms import current_platform
    except Exception as exc:  # not installed, or a build that cannot load here
        return f"vllm not importable: {exc!r}"
    if not current_platform.is_cuda():
        return f"vllm platform is {current_platform.device_type!r}, not CUDA"
    return None


def _model(directory: Path, max_len: int) -> None:
    """A Llama config.json and nothing else: dummy weights need no files."""
    directory.mkdir(parents=True)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **MODEL,
              "max_position_embeddings": max_len, "torch_dtype": "bfloat16",
              "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
              "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2}
    (directory / "config.json").write_text(json.dumps(config, indent=2))


def run(contexts: list[int], paths: list[str], trials: int) -> dict[str, Any]:
    import torch

    max_len = max(contexts) + 64
    engine_kwargs = {"load_format": "dummy", "skip_tokenizer_init": True,
                     "max_model_len": max_len, "gpu_memory_utilization": 0.6,
                     "max_num_batched_tokens": max_len}
    out: dict[str, Any] = {"model": MODEL, "context_tokens": contexts, "block_tokens":
                           cpu_bench.BLOCK, "recompute_ttft_s": {}, "restore_ttft_s": {},
                           "restore_over_recompute": {}, "outputs_identical": {}}
    with tempfile.TemporaryDirectory(prefix="kvkeep-gpu-vllm-") as tmp:
        model = Path(tmp) / "model"
        _model(model, max_len)
        for path in paths:
            store = {"host_bytes": 12 << 30, "name": f"gpu-{path}",
                     "host_pinned": path == "staged" and torch.cuda.is_available()}
            kv = cpu_bench.kv_config(store, restore_path=path, restore_deadline_ms=60000)
            progress(f"engine with restore_path {path}")
            recompute, restore, same = [], [], True
            with cpu_bench.vllm_engine(model, kv, **engine_kwargs) as llm:
                cpu_bench.generate(llm, cpu_bench.random_prompts(1, 256, 1, MODEL["vocab_size"]), 4)
                for ctx in contexts:
                    prompts = cpu_bench.random_prompts(trials, ctx, ctx, MODEL["vocab_size"])
                    times = []
                    for prompt in prompts:  # each new to the store: a recompute
                        llm.reset_prefix_cache()
                        start = time.perf_counter()
                        cpu_bench.generate(llm, [prompt], 1)
                        times.append(time.perf_counter() - start)
                    recompute.append(sorted(times)[len(times) // 2])
                    reference, _ = cpu_bench.generate(llm, [prompts[-1]], 16)
                    restorable = (ctx - 1) // cpu_bench.BLOCK * cpu_bench.BLOCK
                    seconds, _ = cpu_bench._ttft(llm, prompts[-1], trials,
                                                 expect_cached=restorable)
                    restore.append(seconds)
                    llm.reset_prefix_cache()
                    tokens, _ = cpu_bench.generate(llm, [prompts[-1]], 16)
                    same &= tokens == reference
            out["recompute_ttft_s"][path] = recompute
            out["restore_ttft_s"][path] = restore
            out["restore_over_recompute"][path] = [round(r / c, 4) for r, c in
                                                   zip(restore, recompute, strict=True)]
            out["outputs_identical"][path] = same
    return out


def main(argv: list[str] | None = None) -> int:
    def shape(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--contexts", type=int, nargs="+",
                            help="prompt lengths (default 2048 8192; --quick: 2048)")
        parser.add_argument("--paths", nargs="+", choices=("auto", "device_decode", "staged"),
                            default=["auto", "staged"])
        parser.add_argument("--trials", type=int, default=3)

    def measure(args: argparse.Namespace) -> dict[str, Any]:
        why = _why_not()
        if why is not None:
            progress(f"skipped: {why}")
            return {"skipped": why}
        contexts = args.contexts or ([2048] if args.quick else [2048, 8192])
        return run(contexts, args.paths, args.trials)

    return run_benchmark("gpu_vllm", measure, as_json, argv, extra_args=shape)


if __name__ == "__main__":
    sys.exit(main())
