"""Test blocks: keys and checksummed frames of random bytes, built with kvstore.frame only.

Deliberately independent of the codecs (developed in parallel): a frame here is random bytes per
layer, which is all the tiers and the store ever look at.
"""

from __future__ import annotations

import random

from kvstore.frame import CodecId, Compression, DType, build_frame
from kvstore.keys import BlockKey, ModelFingerprint, Namespace, SessionKey

__all__ = ["FINGERPRINT", "NAMESPACE", "block_key", "session_key", "make_frame", "corrupt"]

FINGERPRINT = ModelFingerprint(
    model_id="test/tiny", weights_digest="w0", dtype="float16", num_layers=4, num_kv_heads=2,
    head_size=16, block_size=16, layout_id="nhd", codec="raw")
NAMESPACE = Namespace("tenant-a")


def block_key(i: int, namespace: Namespace = NAMESPACE) -> BlockKey:
    return BlockKey.of(FINGERPRINT, namespace, i.to_bytes(8, "little") + b"blk")


def session_key(name: str = "s1") -> SessionKey:
    return SessionKey.of(FINGERPRINT, NAMESPACE, name)


def make_frame(key: BlockKey, *, layers: int = 4, segment_bytes: int = 1024,
               seed: int | None = None) -> bytes:
    """A valid frame bound to `key`: `layers` segments of random bytes."""
    rng = random.Random(seed if seed is not None else key.digest)
    segments = [(rng.randbytes(segment_bytes), Compression.NONE, segment_bytes)
                for _ in range(layers)]
    return build_frame(segments, codec=CodecId.RAW, dtype=DType.FLOAT16, layout_id="nhd",
                       token_count=16, layer_shape=(2, segment_bytes // 4), key_digest=key.digest)


def corrupt(frame: bytes, offset_from_end: int = 1) -> bytes:
    """The frame with one payload bit flipped (the header stays valid, a segment does not)."""
    data = bytearray(frame)
    data[-offset_from_end] ^= 0x01
    return bytes(data)
