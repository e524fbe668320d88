"""Every lossy codec through the connector in real vLLM engines: saved by one engine, restored
by a fresh one, quantized along the axes the engine's KV layout really has.

On this kind of CPU (AMX) vLLM stores bf16 blocks in the AMX kernel's packing (`cpu-amx/raw`)
and fp16 ones in the canonical arrangement (`cpu/tnhd`, the `vec` kernel: AMX is used for bf16
only); elsewhere both are canonical. Both dtypes run (and two block sizes), so both
arrangements are covered wherever AMX exists; the tests derive everything from the engine's
own layout.

What is checked, per codec and engine (dtype, block size):
- the frames the connector saved are byte for byte what the codec gives for the raw KV an
  engine with the raw codec saved for the same prompts, encoded in the layout's arrangement:
  quantizing along the wrong axes (or with the wrong arrangement recorded) would differ;
- a fresh engine restores every full prompt block from them, with nothing corrupt or
  mismatched, and its greedy tokens are reported against the raw-restored engine's;
- decoded K and V are within the codec's error of the raw KV.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvstore.block import decode_frame
from kvstore.codecs import Arrangement, get_codec
from kvstore.codecs.arrangement import to_canonical
from kvstore.frame import BlockRead
from kvstore.keys import BlockKey, Namespace
from kvstore.store import TieredStore
from kvstore.tiers.factory import NvmeSpec
from tests.connector_harness import (
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

PROMPTS = random_prompts(4, [70, 100, 150, 97], seed=41)
MAX_TOKENS = 12
# Relative RMS error of decoded K (and V) against raw that each codec stays under on this
# model's KV (measured: int8 schemes 0.3-1 %, int4 ~8 %); a wrong axis or scale is far above.
MAX_REL_RMS = {"int8-sym": 0.02, "int8-asym": 0.02, "int8-kivi": 0.02, "int8-g32": 0.02,
               "int4": 0.15}
ENGINES = {"bf16": {"dtype": "bfloat16", "block_size": 32},
           "fp16": {"dtype": "float16", "block_size": 32},
           "bf16-b64": {"dtype": "bfloat16", "block_size": 64}}
CASES = [("int8-sym", "bf16"), ("int8-asym", "bf16"), ("int8-kivi", "bf16"),
         ("int8-g32", "bf16"), ("int4", "bf16"), ("int8-kivi", "fp16"), ("int4", "fp16"),
         ("int8-g32", "fp16"), ("int8-asym", "bf16-b64")]


def _nvme(path: Path) -> dict[str, Any]:
    return {"nvme": {"path": str(path), "bytes": 256 << 20}}


def _open_store(path: Path) -> TieredStore:
    return TieredStore.from_specs([NvmeSpec(str(path), 256 << 20)])


@pytest.fixture(scope="module")
def raw_runs(tiny: TinyModel, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[dict[str, dict[str, Any]]]:
    """Per engine kind: an engine with the raw codec saves the prompts' KV and generates; a
    fresh one restores it (the reference tokens). Built when first asked for."""
    class Runs(dict[str, dict[str, Any]]):
        def __missing__(self, kind: str) -> dict[str, Any]:
            data = tmp_path_factory.mktemp(f"raw-{kind}")
            config = kv_transfer_config(_nvme(data), codec="raw")
            with open_engine(tiny.path, config, **ENGINES[kind]) as llm:
                generate(llm, PROMPTS, MAX_TOKENS)
                fingerprint = scheduler_connector(llm).fingerprint
            with open_engine(tiny.path, config, **ENGINES[kind]) as llm:
                restored = generate(llm, PROMPTS, MAX_TOKENS)
            self[kind] = {"data": data, "fingerprint": fingerprint,
                          "tokens": [r.tokens for r in restored]}
            return self[kind]

    runs = Runs()
    yield runs


def _frames(data: Path, fingerprint: Any, block: int) -> list[tuple[BlockKey, bytes]]:
    store = _open_store(data)
    try:
        out = []
        for prompt in PROMPTS:
            for h in block_hashes(prompt, block):
                key = BlockKey.of(fingerprint, Namespace("default"), h)
                read = store.get(key)
                assert read is not None, "every full prompt block was saved"
                out.append((key, read.to_frame()))
        return out
    finally:
        store.close()


@pytest.mark.parametrize(("codec", "kind"), CASES, ids=[f"{c}-{k}" for c, k in CASES])
def test_codec_saves_along_the_layouts_axes_and_restores_in_a_fresh_engine(
        tiny: TinyModel, tmp_path: Path, raw_runs: dict[str, dict[str, Any]], codec: str,
        kind: str, record_property: pytest.RecordProperty) -> None:
    raw = raw_runs[kind]
    block = int(ENGINES[kind]["block_size"])
    config = kv_transfer_config(_nvme(tmp_path), codec=codec)
    with open_engine(tiny.path, config, **ENGINES[kind]) as llm:
        generate(llm, PROMPTS, MAX_TOKENS)
        fingerprint = scheduler_connector(llm).fingerprint
        layout = fingerprint.layout_id
    arrangement = Arrangement.AMX if layout.startswith("cpu-amx/") else Arrangement.CANONICAL
    with open_engine(tiny.path, config, **ENGINES[kind]) as llm:
        restored = generate(llm, PROMPTS, MAX_TOKENS)
        counters = worker_connector().counters()
    assert [r.num_cached_tokens for r in restored] == [
        (len(p) - 1) // block * block for p in PROMPTS]
    assert counters["load_corrupt"] == 0 and counters["load_mismatch"] == 0
    assert counters["loaded_blocks"] == sum((len(p) - 1) // block for p in PROMPTS)

    coder = get_codec(codec)
    errors: dict[str, list[float]] = {"k": [], "v": []}
    raw_frames = _frames(raw["data"], raw["fingerprint"], block)
    saved = _frames(tmp_path, fingerprint, block)
    for (raw_key, raw_frame), (key, frame) in zip(raw_frames, saved, strict=True):
        layers = decode_frame(raw_frame, key=raw_key, device="cpu")
        header = BlockRead.from_frame(frame).header
        assert header.codec is coder.codec_id and header.layout_id == layout
        # What the codec gives for the raw KV in this layout's arrangement, byte for byte.
        want = [bytes(d) for d in coder.encode_many(layers, arrangement=arrangement).data]
        read = BlockRead.from_frame(frame)
        assert [bytes(read.segment(i)) for i in range(header.num_layers)] == want
        for exact, lossy in zip(layers, decode_frame(frame, key=key, device="cpu"),
                                strict=True):
            a = to_canonical(exact.float().numpy(), arrangement)
            b = to_canonical(lossy.float().numpy(), arrangement)
            for plane, name in ((0, "k"), (1, "v")):
                errors[name].append(float(np.sqrt(np.mean((a[plane] - b[plane]) ** 2))
                                          / np.sqrt(np.mean(a[plane] ** 2))))
    k_err, v_err = max(errors["k"]), max(errors["v"])
    same = [r.tokens == ref for r, ref in zip(restored, raw["tokens"], strict=True)]
    record_property(f"{codec}_{kind}_k_rel_rms", round(k_err, 5))
    record_property(f"{codec}_{kind}_v_rel_rms", round(v_err, 5))
    record_property(f"{codec}_{kind}_identical_continuations", sum(same))
    print(f"{codec} {kind} ({layout}): K rel RMS {k_err:.4f}, V {v_err:.4f}, "
          f"{sum(same)}/{len(same)} continuations equal the raw restore's")
    assert k_err <= MAX_REL_RMS[codec] and v_err <= MAX_REL_RMS[codec]
    assert torch.tensor(errors["k"]).isfinite().all()
