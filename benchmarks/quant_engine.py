"""The engine half of `benchmarks.quant`: per model and codec, KV saved by the connector in one
vLLM engine and restored into a fresh one; greedy, teacher-forced and K/V error figures.

See `benchmarks/quant.py` for what each figure means.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from kvstore.block import decode_frame
from kvstore.codecs import Arrangement, get_codec
from kvstore.codecs.arrangement import from_canonical, to_canonical
from kvstore.keys import BlockKey, ModelFingerprint, Namespace
from kvstore.store import TieredStore
from kvstore.tiers.factory import NvmeSpec

if TYPE_CHECKING:
    from vllm import LLM

    from deploy.local.model import TinyModel

__all__ = ["EngineKind", "evaluate_model"]

BLOCK = 32


@dataclass(frozen=True, slots=True)
class EngineKind:
    """Engines of one dtype (which, on a CPU, also decides vLLM's KV layout)."""

    name: str
    dtype: str


@contextlib.contextmanager
def _engine(model: Path, codec: str, store: Path, dtype: str, vocab: int) -> Iterator[LLM]:
    from vllm import LLM

    from kvstore.codecs.llvmlite_compat import patch_llvmlite_for_vllm

    patch_llvmlite_for_vllm()
    kv = {"kv_connector": "KVKeepConnector", "kv_connector_module_path": "connectors.vllm",
          "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
          "kv_connector_extra_config": {
              "store": {"nvme": {"path": str(store), "bytes": 1 << 30, "durable": False}},
              "codec": codec, "restore_deadline_ms": 30000}}
    args: dict[str, Any] = {"dtype": dtype, "block_size": BLOCK, "enforce_eager": True,
                            "seed": 0, "max_model_len": 1024,
                            "kv_cache_memory_bytes": 128 << 20, "max_logprobs": vocab}
    llm = LLM(model=str(model), kv_transfer_config=kv, **args)
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def _fingerprint(llm: LLM) -> ModelFingerprint:
    connector = llm.llm_engine.engine_core.engine_core.scheduler.connector  # type: ignore[attr-defined]
    fingerprint: ModelFingerprint = connector.fingerprint
    return fingerprint


def _generate(llm: LLM, prompts: Sequence[Sequence[int]], tokens: int, logprobs: int | None = None
              ) -> tuple[list[tuple[int, ...]], list[int], list[Any]]:
    from vllm import SamplingParams

    sampling = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True,
                              detokenize=False, logprobs=logprobs)
    outs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts],  # type: ignore[arg-type]
                        sampling, use_tqdm=False)
    return ([tuple(o.outputs[0].token_ids) for o in outs],
            [int(o.num_cached_tokens or 0) for o in outs],
            [o.outputs[0].logprobs for o in outs])


def _distribution(logprobs: Any, vocab: int) -> np.ndarray:
    """The next-token log-probabilities of a one-token generation, over the vocabulary."""
    out = np.full(vocab, -np.inf)
    for token, entry in logprobs[0].items():
        out[token] = entry.logprob
    return out


@dataclass(slots=True)
class _Run:
    """What one codec's save engine and fresh restore engine produced."""

    computed: list[tuple[int, ...]]
    free: list[tuple[int, ...]]
    free_logprobs: list[Any]  # per answer, per position: {token: Logprob} (top 2)
    cached: list[int]
    forced: list[np.ndarray]
    fingerprint: ModelFingerprint
    store: Path


def _run(model: TinyModel, codec: str, store: Path, kind: EngineKind,
         prompts: list[list[int]], tokens: int,
         forced: Callable[[list[tuple[int, ...]]], list[list[int]]]) -> _Run:
    """Save with `codec` in one engine, then restore into a fresh one: free-running answers,
    and the next-token distributions of the teacher-forced prompts `forced(answers)` builds
    (from this run's own answers for the raw reference, from the reference's for the rest)."""
    with _engine(model.path, codec, store, kind.dtype, model.vocab_size) as llm:
        computed, _, _ = _generate(llm, prompts, tokens)  # computed here, saved with `codec`
    with _engine(model.path, codec, store, kind.dtype, model.vocab_size) as llm:  # fresh
        free, cached, free_logprobs = _generate(llm, prompts, tokens, logprobs=2)
        llm.reset_prefix_cache()  # teacher-forced prefixes come from the store, not from above
        _, _, logprobs = _generate(llm, forced(free), 1, logprobs=model.vocab_size)
        fingerprint = _fingerprint(llm)
    return _Run(computed, free, free_logprobs, cached,
                [_distribution(lp, model.vocab_size) for lp in logprobs], fingerprint, store)


def _match_before_divergence(got: list[tuple[int, ...]], want: list[tuple[int, ...]]) -> float:
    same = 0
    for g, w in zip(got, want, strict=True):
        for a, b in zip(g, w, strict=True):
            if a != b:
                break
            same += 1
    return same / sum(len(w) for w in want)


def _divergence_margins(run: _Run, raw: _Run) -> list[float | None]:
    """For each answer that leaves the reference: by how much the raw model preferred its own
    token over the codec's at the first differing position, in nats (None: the codec's token
    was not even raw's second choice). A flip of a near-tie (a margin of hundredths) is what
    any perturbation of the KV can cause; a wide margin would be the codec's fault."""
    margins: list[float | None] = []
    for got, want, logprobs in zip(run.free, raw.free, raw.free_logprobs, strict=True):
        for position, (a, b) in enumerate(zip(got, want, strict=True)):
            if a != b:
                top = logprobs[position]
                margins.append(round(top[b].logprob - top[a].logprob, 4) if a in top else None)
                break
    return margins


def _block_keys(fingerprint: ModelFingerprint, sequences: Sequence[Sequence[int]]
                ) -> list[bytes]:
    from vllm.utils.hashing import sha256
    from vllm.v1.core import kv_cache_utils

    hashes: list[bytes] = []
    for tokens in sequences:
        parent: Any = None
        for start in range(0, len(tokens) - BLOCK + 1, BLOCK):
            parent = kv_cache_utils.hash_block_tokens(
                sha256, parent, list(tokens[start:start + BLOCK]), None)
            hashes.append(parent)
    return hashes


def _kv_errors(raw: _Run, run: _Run, codec: str, arrangement: Arrangement,
               sequences: Sequence[Sequence[int]]) -> dict[str, Any]:
    """K and V error of the codec's saved frames against the raw ones, in the engine's layout,
    and (tensor level) of the same KV encoded in the other arrangement."""
    other = Arrangement.CANONICAL if arrangement is Arrangement.AMX else Arrangement.AMX
    sums = {(a, p): [0.0, 0.0] for a in ("engine", "other") for p in ("k", "v")}
    raw_store = TieredStore.from_specs([NvmeSpec(str(raw.store), 1 << 30)])
    codec_store = TieredStore.from_specs([NvmeSpec(str(run.store), 1 << 30)])
    coder = get_codec(codec)
    blocks = 0
    peaks: list[float] = []
    try:
        for block_hash in _block_keys(raw.fingerprint, sequences):
            raw_key = BlockKey.of(raw.fingerprint, Namespace("default"), block_hash)
            key = BlockKey.of(run.fingerprint, Namespace("default"), block_hash)
            raw_read, read = raw_store.get(raw_key), codec_store.get(key)
            if raw_read is None or read is None:
                continue
            blocks += 1
            raw_layers: list[Any] = decode_frame(raw_read.to_frame(), key=raw_key, device="cpu")
            exact = [t.float().numpy() for t in raw_layers]
            lossy_layers: list[Any] = decode_frame(read.to_frame(), key=key, device="cpu")
            lossy = [t.float().numpy() for t in lossy_layers]
            moved = [from_canonical(to_canonical(t.view(_int16()).numpy(), arrangement), other)
                     for t in raw_layers]
            dtype = raw_layers[0].dtype
            encoded = coder.encode_many([np.ascontiguousarray(m) for m in moved],
                                        dtype=str(dtype), arrangement=other)
            for i, (a, b) in enumerate(zip(exact, lossy, strict=True)):
                a_c, b_c = to_canonical(a, arrangement), to_canonical(b, arrangement)
                o = coder.decode(encoded.data[i], encoded.shape, encoded.dtype, device="cpu")
                o_c = to_canonical(o.float().numpy(), other)  # type: ignore[union-attr]
                for plane, name in ((0, "k"), (1, "v")):
                    ref = a_c[plane].astype(np.float64)
                    for where, got in (("engine", b_c[plane]), ("other", o_c[plane])):
                        sums[(where, name)][0] += float(np.sum((ref - got) ** 2))
                        sums[(where, name)][1] += float(np.sum(ref ** 2))
                peaks.append(_outlier_ratio(a_c[0]))
    finally:
        raw_store.close()
        codec_store.close()

    def rel(where: str, plane: str) -> float:
        err, ref = sums[(where, plane)]
        return round(float(np.sqrt(err / ref)), 6) if ref else float("nan")

    return {"blocks": blocks, "k": rel("engine", "k"), "v": rel("engine", "v"),
            "other_arrangement": other.name.lower(), "other_k": rel("other", "k"),
            "other_v": rel("other", "v"),
            "k_outlier_ratio": round(float(np.median(peaks)), 2) if peaks else float("nan")}


def _int16() -> Any:
    import torch

    return torch.int16


def _outlier_ratio(k: np.ndarray) -> float:
    """Largest over median per-channel absmax of a K block [N, H, D], per head, averaged:
    how far a trained model's K outlier channels stand out (1-2 for Gaussian noise)."""
    peak = np.abs(k).max(axis=0)  # [H, D]
    return float(np.mean(peak.max(axis=1) / np.maximum(np.median(peak, axis=1), 1e-30)))


def _constant(prompts: list[list[int]]) -> Callable[[list[tuple[int, ...]]], list[list[int]]]:
    """Teacher-forced prompts that do not depend on the run's own answers."""
    def forced(_: list[tuple[int, ...]]) -> list[list[int]]:
        return prompts
    return forced


def evaluate_model(name: str, model: TinyModel, codecs: Sequence[str], tmp: Path, *,
                   kinds: Sequence[EngineKind], prompts: int, tokens: int,
                   forced_every: int) -> dict[str, Any]:
    from deploy.local.corpus import HELD_OUT
    from deploy.local.training import heldout_prompts

    lengths = [96 + 12 * i for i in range(prompts)]
    cases = heldout_prompts(model.path, lengths, seed=12)
    per_kind: dict[str, dict[str, Any]] = {}
    layouts: dict[str, str] = {}
    bit_exact = True
    for kind in kinds:
        started = time.perf_counter()

        def teacher_forced(answers: list[tuple[int, ...]]) -> list[list[int]]:
            return [list(p) + list(answer[:k]) for p, answer in zip(cases, answers, strict=True)
                    for k in range(0, tokens, forced_every)]

        raw = _run(model, "raw", tmp / f"{kind.name}-raw", kind, cases, tokens, teacher_forced)
        reference = raw.free
        forced = teacher_forced(reference)
        bit_exact &= raw.free == raw.computed and raw.cached == [
            (len(p) - 1) // BLOCK * BLOCK for p in cases]
        layout = raw.fingerprint.layout_id
        layouts[kind.name] = layout
        arrangement = Arrangement.AMX if layout.startswith("cpu-amx/") else \
            Arrangement.CANONICAL
        sequences = [list(p) + list(ref) for p, ref in zip(cases, reference, strict=True)]
        figures: dict[str, Any] = {}
        for codec in codecs:
            run = _run(model, codec, tmp / f"{kind.name}-{codec}", kind, cases, tokens,
                       _constant(forced))
            kl, top1 = [], []
            for p, q in zip(raw.forced, run.forced, strict=True):
                probs = np.exp(p)
                kl.append(float(np.sum(np.where(probs > 0, probs * (p - q), 0.0))))
                top1.append(int(np.argmax(p) == np.argmax(q)))
            errors = _kv_errors(raw, run, codec, arrangement, sequences)
            figures[codec] = {
                "token_match": round(_match_before_divergence(run.free, reference), 4),
                "identical_continuations": sum(f == r for f, r in zip(run.free, reference,
                                                                      strict=True)),
                "divergence_margins_nats": _divergence_margins(run, raw),
                "top1": round(float(np.mean(top1)), 4),
                "kl": float(f"{np.mean(kl):.3g}"),
                "kl_p99": float(f"{np.quantile(kl, 0.99):.3g}"),
                "k_rel_rms": errors["k"], "v_rel_rms": errors["v"],
                f"k_rel_rms_{errors['other_arrangement']}": errors["other_k"],
                f"v_rel_rms_{errors['other_arrangement']}": errors["other_v"],
                "blocks_compared": errors["blocks"],
                "k_outlier_ratio": errors["k_outlier_ratio"],
                "restored_all": run.cached == raw.cached,
                "saving_pass_unchanged": run.computed == raw.computed,
            }
        per_kind[kind.name] = {"layout": layout, "codecs": figures,
                               "seconds": round(time.perf_counter() - started, 1)}
    first = per_kind[kinds[0].name]
    codecs_out: dict[str, Any] = {}
    for codec in codecs:
        rows = [per_kind[k.name]["codecs"][codec] for k in kinds]
        codecs_out[codec] = {
            "token_match": min(r["token_match"] for r in rows),
            "top1": min(r["top1"] for r in rows),
            "kl": max(r["kl"] for r in rows),
            "k_rel_rms": max(r["k_rel_rms"] for r in rows),
            "v_rel_rms": max(r["v_rel_rms"] for r in rows),
            "by_engine": {k.name: per_kind[k.name]["codecs"][codec] for k in kinds},
        }
    outlier = first["codecs"][codecs[0]]["k_outlier_ratio"] if codecs else float("nan")
    return {
        "model": {"name": name, "layers": model.layers, "hidden": model.hidden,
                  "heads": model.heads, "kv_heads": model.kv_heads,
                  "head_dim": model.head_dim, "vocab": model.vocab_size,
                  "train_loss": model.train_loss, "heldout_loss": model.heldout_loss,
                  "k_outlier_ratio": outlier, "prompts": len(cases),
                  "prompt_tokens": [min(lengths), max(lengths)], "answer_tokens": tokens,
                  "teacher_forced_points": len(forced),
                  "prompt_source": f"held-out licence text ({', '.join(HELD_OUT)})"},
        "codecs": codecs_out,
        "layouts": layouts,
        "raw_restore_bit_exact": bit_exact,
        "engines": {k: {"layout": v["layout"], "seconds": v["seconds"]}
                    for k, v in per_kind.items()},
    }
