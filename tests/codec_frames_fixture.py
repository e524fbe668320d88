"""Writes `tests/codec_frames.json`: frames that later versions of kvkeep must still decode.

    python -m tests.codec_frames_fixture            # (re)writes the grouped codecs' entries

Two kinds of entries, each a whole frame (hex) and the sha256 of the bits each of its layers
decodes to:

- `before_grouped`: `raw` and `int8` frames encoded by kvkeep at commit e34cbbf, before the
  grouped codecs existed (the int8 codec is `int8-sym` now). Never regenerated: they are the
  old frames the issue asks to keep readable.
- `grouped`: one frame per grouped codec, canonical and AMX arrangements, encoded when the
  codec was introduced. Regenerate only for a deliberate change of a codec's format, which
  must then get a new codec id instead (frames written by the old one would not decode).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch

from kvstore.block import decode_frame, encode_block
from kvstore.codecs import Arrangement
from kvstore.keys import BlockKey, ModelFingerprint, Namespace

FIXTURE = Path(__file__).with_name("codec_frames.json")
GROUPED = ("int8-asym", "int8-kivi", "int8-g32", "int4")


def fixture_key() -> BlockKey:
    fp = ModelFingerprint("fixture", "w", "bfloat16", 2, 2, 8, 4, "cpu/tnhd", "int8")
    return BlockKey.of(fp, Namespace("fixture"), bytes(range(32)))


def _layers(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    layers = [torch.randn(*shape, generator=g) * (1 + 3 * i) for i in range(2)]
    layers[1].view(-1)[3::shape[-1]] *= 25  # one outlier channel
    return [x.to(dtype) for x in layers]


def grouped_entries() -> list[dict[str, Any]]:
    key = fixture_key()
    entries = []
    cases = [(Arrangement.CANONICAL, (2, 16, 1, 32), torch.bfloat16),
             (Arrangement.AMX, (1, 32, 32), torch.bfloat16)]
    for codec in GROUPED:
        for seed, (arrangement, shape, dtype) in enumerate(cases):
            layers = _layers(shape, dtype, seed)
            frame = encode_block(layers, codec=codec, key=key, token_count=16,
                                 layout_id=f"fixture-{arrangement.name.lower()}",
                                 compression="none", arrangement=arrangement)
            decoded = decode_frame(frame, key=key, device="cpu")
            entries.append({"codec": codec, "dtype": str(dtype),
                            "arrangement": arrangement.name, "frame": frame.hex(),
                            "decoded": [bits_digest(t) for t in decoded]})
    return entries


def bits_digest(t: Any) -> str:
    """sha256 of a decoded layer's bits (its dtype's bytes, C order)."""
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def main() -> None:
    data = json.loads(FIXTURE.read_text()) if FIXTURE.exists() else {}
    data["grouped"] = grouped_entries()
    FIXTURE.write_text(json.dumps(data, indent=1) + "\n")


if __name__ == "__main__":
    main()
