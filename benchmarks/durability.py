"""What `durability` costs per response on a real vLLM engine (CPU): write-behind vs durable.

    python -m benchmarks.durability --quick --json OUT.json

Two `kvkeep store serve` daemons on loopback, R=2. The same random-weight Llama
(`load_format="dummy"`) runs twice, one engine after the other: with the connector saving by
write-behind (the default: the baseline, measured in the same run) and with
`"durability": {"replicas": 2}` (every step that completes blocks returns once both daemons
acknowledged them). Each response is a fresh prompt (nothing deduplicated) of 128-2048 tokens
and 8 (32) generated tokens; the figure is the median wall time of a response (the better of
two alternating rounds of engines), and
`durable_over_write_behind` their ratio per size (`extra_ms`: the difference). Also reported:
the copy lag to the R-th daemon (`kvkeep_store_copy_lag_seconds{tier="remote"}`) of each
engine's store, as mean seconds, which is the window a node lost takes its KV along with.

Writes::

    {"model": {...}, "prompt_tokens": [..], "decode_tokens": n,
     "write_behind_s": [..], "durable_s": [..], "durable_over_write_behind": [..],
     "extra_ms": [..], "copy_lag_mean_s": {"write_behind": f, "durable": f}}
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from benchmarks.cli import run_benchmark
from benchmarks.plots import RatioPanel
from benchmarks.progress import progress
from deploy.local.ports import free_port

for _name, _value in {"HF_HUB_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                      "OMP_NUM_THREADS": "1", "VLLM_NO_USAGE_STATS": "1",
                      "TOKENIZERS_PARALLELISM": "false"}.items():
    os.environ.setdefault(_name, _value)

__all__ = ["main", "run"]

BLOCK = 32
VOCAB = 8192
ROUNDS = 2


@contextlib.contextmanager
def _daemons(tmp: Path, count: int) -> Iterator[dict[str, str]]:
    """`count` daemons on loopback, by node id."""
    procs: list[subprocess.Popen[bytes]] = []
    addresses: dict[str, str] = {}
    try:
        for i in range(count):
            port = free_port()
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "kvstore.daemon", "--listen", f"127.0.0.1:{port}",
                 "--data-dir", str(tmp / f"daemon-{i}"), "--mem-budget", "1GiB",
                 "--disk-budget", "4GiB", "--node-id", f"d{i}"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            addresses[f"d{i}"] = f"127.0.0.1:{port}"
        for proc, address in zip(procs, addresses.values(), strict=True):
            host, port_text = address.rsplit(":", 1)
            end = time.monotonic() + 30
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"a daemon exited with {proc.returncode}")
                with contextlib.suppress(OSError), socket.create_connection(
                        (host, int(port_text)), 0.2):
                    break
                if time.monotonic() > end:
                    raise TimeoutError("a daemon did not start listening")
                time.sleep(0.05)
        yield addresses
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _model(directory: Path, hidden: int, layers: int) -> dict[str, Any]:
    from transformers import LlamaConfig

    heads, kv_heads = hidden // 64, max(1, hidden // 128)
    LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                num_hidden_layers=layers, num_attention_heads=heads,
                num_key_value_heads=kv_heads, head_dim=64, max_position_embeddings=8192,
                torch_dtype="bfloat16").save_pretrained(directory)  # type: ignore[call-arg]
    return {"hidden": hidden, "layers": layers, "kv_heads": kv_heads, "head_dim": 64,
            "weights": "dummy", "dtype": "bfloat16", "block_size": BLOCK}


def _responses(model: Path, daemons: dict[str, str], *, durable: bool,
               sizes: Sequence[int], decode: int, trials: int, seed: int
               ) -> tuple[list[float], float]:
    """Median seconds per response at each size, and the store's mean remote copy lag."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from kvstore.codecs.llvmlite_compat import patch_llvmlite_for_vllm

    patch_llvmlite_for_vllm()
    extra: dict[str, Any] = {
        "store": {"host_bytes": 256 << 20, "name": "durable" if durable else "write-behind",
                  "remote": {"daemons": daemons, "replicas": 2, "timeout_ms": 5000}}}
    if durable:
        extra["durability"] = {"replicas": 2, "timeout_ms": 10000}
    kv = {"kv_connector": "KVKeepConnector", "kv_connector_module_path": "connectors.vllm",
          "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
          "kv_connector_extra_config": extra}
    llm = LLM(model=str(model), dtype="bfloat16", block_size=BLOCK, enforce_eager=True, seed=0,
              kv_transfer_config=kv, load_format="dummy", max_model_len=4096,
              kv_cache_memory_bytes=512 << 20, disable_log_stats=True,
              skip_tokenizer_init=True)
    rng = random.Random(seed)
    sampling = SamplingParams(temperature=0, max_tokens=decode, ignore_eos=True,
                              detokenize=False)
    try:
        # One unmeasured response: first-call costs (connections, allocations).
        llm.generate([TokensPrompt(prompt_token_ids=[rng.randrange(10, VOCAB)
                                                     for _ in range(64)])],
                     sampling, use_tqdm=False)
        medians = []
        for size in sizes:
            times = []
            for _ in range(trials):
                prompt = [rng.randrange(10, VOCAB) for _ in range(size)]
                start = time.perf_counter()
                llm.generate([TokensPrompt(prompt_token_ids=prompt)], sampling, use_tqdm=False)
                times.append(time.perf_counter() - start)
            medians.append(statistics.median(times))
            progress(f"{'durable' if durable else 'write-behind'} {size} tokens: "
                     f"{medians[-1] * 1000:.0f} ms")
        from connectors.vllm.config import ConnectorConfig
        from connectors.vllm.stores import acquire_existing_store, release_store

        spec = ConnectorConfig.from_extra(extra).store
        store = acquire_existing_store(spec)  # the engine's own (same process)
        try:
            lag = _mean_remote_copy_lag(store) if store is not None else float("nan")
        finally:
            if store is not None:
                release_store(spec)
        return medians, lag
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm


def _mean_remote_copy_lag(store: Any) -> float:
    total = count = 0.0
    store.flush(30)  # the write-behind engine's last copies land first
    for metric in store.metrics.copy_lag.collect():
        for sample in metric.samples:
            if sample.labels.get("tier") != "remote":
                continue
            if sample.name.endswith("_sum"):
                total += sample.value
            elif sample.name.endswith("_count"):
                count += sample.value
    return total / count if count else float("nan")


def run(*, quick: bool) -> dict[str, Any]:
    sizes = [128, 512] if quick else [128, 512, 2048]
    decode = 8 if quick else 32
    trials = 3 if quick else 7
    with tempfile.TemporaryDirectory(prefix="kvkeep-durability-") as tmp:
        root = Path(tmp)
        model = _model(root / "model", 256 if quick else 1024, 4 if quick else 8)
        with _daemons(root, 2) as daemons:
            # Alternating engines (write-behind, durable, write-behind, durable): a machine
            # whose load drifts during the run biases neither side.
            times: dict[bool, list[list[float]]] = {False: [], True: []}
            lags: dict[bool, list[float]] = {False: [], True: []}
            for round_ in range(ROUNDS):
                for durable_engine in (False, True):
                    medians, lag = _responses(root / "model", daemons, durable=durable_engine,
                                              sizes=sizes, decode=decode, trials=trials,
                                              seed=10 * round_ + durable_engine)
                    times[durable_engine].append(medians)
                    lags[durable_engine].append(lag)
    behind = [min(r[i] for r in times[False]) for i in range(len(sizes))]
    durable = [min(r[i] for r in times[True]) for i in range(len(sizes))]
    behind_lag, durable_lag = statistics.mean(lags[False]), statistics.mean(lags[True])
    return {"model": model, "prompt_tokens": sizes, "decode_tokens": decode,
            "write_behind_s": behind, "durable_s": durable,
            "durable_over_write_behind": [d / b for d, b in zip(durable, behind, strict=True)],
            "extra_ms": [(d - b) * 1000 for d, b in zip(durable, behind, strict=True)],
            "copy_lag_mean_s": {"write_behind": behind_lag, "durable": durable_lag}}


def render(results: dict[str, Any]) -> str:
    lines = ["prompt  write-behind  durable  ratio  extra"]
    for size, b, d, r in zip(results["prompt_tokens"], results["write_behind_s"],
                             results["durable_s"], results["durable_over_write_behind"],
                             strict=True):
        lines.append(f"{size:6d}  {b * 1000:9.0f} ms {d * 1000:6.0f} ms  {r:5.2f}  "
                     f"{(d - b) * 1000:+.0f} ms")
    lags = results["copy_lag_mean_s"]
    lines.append(f"mean copy lag to the 2nd daemon: write-behind {lags['write_behind'] * 1000:.1f}"
                 f" ms, durable {lags['durable'] * 1000:.1f} ms")
    return "\n".join(lines)


def plots(results: dict[str, Any]) -> list[RatioPanel]:
    return []


def main(argv: Sequence[str] | None = None) -> int:
    def measure(args: argparse.Namespace) -> dict[str, Any]:
        return run(quick=args.quick)

    return run_benchmark("durability", measure, render, argv)


if __name__ == "__main__":
    raise SystemExit(main())
