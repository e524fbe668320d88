"""Keys, fingerprints, namespaces and session manifests."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvstore.errors import CorruptBlock, InvalidKey
from kvstore.keys import (
    BlockHash,
    BlockKey,
    ModelFingerprint,
    Namespace,
    SessionKey,
    validate_session_id,
)
from kvstore.manifest import SessionManifest

BASE = ModelFingerprint(model_id="tiny-llama", weights_digest="sha256:abc", dtype="bfloat16",
                        num_layers=2, num_kv_heads=2, head_size=32, block_size=32,
                        layout_id="cpu-lbhnc", codec="raw")


@pytest.mark.parametrize(
    "change",
    [
        {"model_id": "other"},
        {"weights_digest": "sha256:abd"},
        {"dtype": "float16"},
        {"num_layers": 3},
        {"num_kv_heads": 4},
        {"head_size": 64},
        {"block_size": 64},
        {"layout_id": "cuda-flash"},
        {"codec": "int8"},
    ],
)
def test_any_fingerprint_change_changes_the_digest_and_the_block_key(change: dict[str, object]
                                                                     ) -> None:
    other = dataclasses.replace(BASE, **change)  # type: ignore[arg-type]
    assert other.digest != BASE.digest
    ns = Namespace("acme")
    assert BlockKey.of(other, ns, b"h" * 32).digest != BlockKey.of(BASE, ns, b"h" * 32).digest


def test_fingerprint_is_stable_across_instances() -> None:
    again = dataclasses.replace(BASE)
    assert again.digest == BASE.digest
    assert len(BASE.digest) == 16


def test_namespaces_separate_tenants_and_salts() -> None:
    digests = {
        BlockKey.of(BASE, ns, b"x" * 32).digest
        for ns in (Namespace("a"), Namespace("b"), Namespace("a", "s1"), Namespace("a", "s2"))
    }
    assert len(digests) == 4
    assert Namespace.from_label(Namespace("a", "s1").label) == Namespace("a", "s1")


@pytest.mark.parametrize(
    "bad", ["", "../../etc/passwd", "a/b", "a\x00b", ".hidden", "-x", "x" * 129, "sp ace", "é"]
)
def test_bad_session_ids_are_rejected(bad: str) -> None:
    with pytest.raises(InvalidKey):
        validate_session_id(bad)
    with pytest.raises(InvalidKey):
        SessionKey.of(BASE, Namespace("t"), bad)


@pytest.mark.parametrize("bad", ["", "a/b", "a~b", "x" * 65, ".x", "a\x00"])
def test_bad_tenants_are_rejected(bad: str) -> None:
    with pytest.raises(InvalidKey):
        Namespace(bad)


@pytest.mark.parametrize("bad", [b"", b"x" * 65])
def test_bad_block_hashes_are_rejected(bad: bytes) -> None:
    with pytest.raises(InvalidKey):
        BlockKey.of(BASE, Namespace("t"), bad)


@given(st.text(min_size=1, max_size=200))
def test_validated_session_ids_are_path_safe(value: str) -> None:
    try:
        sid = validate_session_id(value)
    except InvalidKey:
        return
    assert "/" not in sid and "\x00" not in sid and not sid.startswith(".")


def _manifest() -> SessionManifest:
    key = SessionKey.of(BASE, Namespace("acme"), "conv-1")
    return SessionManifest(key, (BlockHash(b"a" * 32), BlockHash(b"b" * 32)), token_count=70,
                           generation=3, token_ids=(1, 2, 3))


def test_manifest_round_trip() -> None:
    manifest = _manifest()
    assert SessionManifest.decode(manifest.encode(), manifest.key) == manifest


def test_manifest_corruption_is_detected() -> None:
    data = bytearray(_manifest().encode())
    for i in range(len(data)):
        for bit in (0, 7):
            flipped = bytearray(data)
            flipped[i] ^= 1 << bit
            with pytest.raises(CorruptBlock):
                SessionManifest.decode(bytes(flipped))


def test_manifest_bound_to_its_key() -> None:
    manifest = _manifest()
    other = SessionKey.of(BASE, Namespace("acme"), "conv-2")
    with pytest.raises(CorruptBlock):
        SessionManifest.decode(manifest.encode(), other)
