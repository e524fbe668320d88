"""Trust review H6: the model fingerprint digests every byte of the weights, never a sample.

Before, weights over 8 GiB were digested as name, size, first and last MiB of each file, so a
new fine-tune of one architecture (same embeddings, same final norm) kept the old fingerprint
and restored the old weights' KV; and within one process the digest was cached by path, size
and mtime, so a file rewritten with its mtime set back kept its old digest even below 8 GiB.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest

from connectors.vllm import weights
from connectors.vllm.weights import CACHE_NAME, weights_digest
from kvstore.errors import ConfigError
from tests.models import TinyModel

_BIG = 9 << 30  # over the old 8 GiB sampling limit; sparse, so it costs no disk


def _sparse_shard(directory: Path, middle_byte: bytes, name: str = "model.safetensors") -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    with open(path, "wb") as f:
        f.truncate(_BIG)
        f.seek(_BIG // 2)
        f.write(middle_byte)
    return path


def _flip_middle_byte_keep_mtime(path: Path) -> None:
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(st.st_size // 2)
        old = f.read(1)
        f.seek(st.st_size // 2)
        f.write(bytes([old[0] ^ 0x01]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # as a copy that keeps times does


def test_one_byte_in_the_middle_of_a_9_gib_shard_changes_the_digest(tmp_path: Path) -> None:
    """The review's probe: two 9 GiB shards that differ in one byte at 4.5 GiB."""
    a, b = tmp_path / "a", tmp_path / "b"
    _sparse_shard(a, b"\1")
    _sparse_shard(b, b"\2")
    assert weights_digest(a) != weights_digest(b)
    # Same content elsewhere (other path, inode, times): the same digest, so two workers with
    # copies of one model share KV.
    c = tmp_path / "c"
    _sparse_shard(c, b"\1")
    assert weights_digest(c) == weights_digest(a)


def test_an_in_place_rewrite_with_its_mtime_set_back_is_seen(tmp_path: Path) -> None:
    """The cached full hash is keyed by ctime and inode too: a write the mtime hides is seen,
    in this process and in the next (the cache file beside the weights)."""
    model = tmp_path / "m"
    shard = _sparse_shard(model, b"\1")
    before = weights_digest(model)
    assert (model / CACHE_NAME).is_file()
    assert weights_digest(model) == before  # from the cache
    _flip_middle_byte_keep_mtime(shard)
    after = weights_digest(model)
    assert after != before
    _flip_middle_byte_keep_mtime(shard)  # back to the original bytes
    assert weights_digest(model) == before


def test_the_cache_is_used_and_a_stale_entry_is_not(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    model = tmp_path / "m"
    model.mkdir()
    shard = model / "model.safetensors"
    shard.write_bytes(os.urandom(1 << 20))
    calls: list[Path] = []
    real = weights.file_digest

    def counting(path: Path) -> str:
        calls.append(path)
        return real(path)

    monkeypatch.setattr(weights, "file_digest", counting)
    first = weights_digest(model)
    assert weights_digest(model) == first and calls == [shard]  # hashed once
    # A replacement (new inode) with equal size and mtime is hashed again.
    st = shard.stat()
    copy = model / "tmp"
    shutil.copyfile(shard, copy)
    os.replace(copy, shard)
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert weights_digest(model) == first and calls == [shard, shard]


def test_hugging_face_blobs_are_named_by_their_sha256(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """An HF cache snapshot's files link to blobs named by their SHA-256: used, not read."""
    repo = tmp_path / "models--org--tiny"

    def snapshot(revision: str, content: bytes) -> Path:
        sha = hashlib.sha256(content).hexdigest()
        (repo / "blobs").mkdir(parents=True, exist_ok=True)
        (repo / "blobs" / sha).write_bytes(content)
        snap = repo / "snapshots" / revision
        snap.mkdir(parents=True)
        (snap / "model.safetensors").symlink_to(Path("../../blobs") / sha)
        return snap

    old = snapshot("a" * 40, b"old weights")
    new = snapshot("b" * 40, b"new weights")

    def refuse(path: Path) -> str:
        raise AssertionError(f"{path} was read: its blob name is its digest")

    monkeypatch.setattr(weights, "file_digest", refuse)
    assert weights_digest(old) != weights_digest(new)
    assert weights_digest(old) == weights_digest(old)


def test_big_weights_with_nowhere_to_cache_a_hash_are_refused(tmp_path: Path) -> None:
    """Over the limit, uncached and uncacheable: refused, naming weights_revision."""
    model = tmp_path / "m"
    _sparse_shard(model, b"\1")
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    nowhere = [blocker / "x", blocker / "y"]
    with pytest.raises(ConfigError, match="weights_revision"):
        weights_digest(model, cache_dirs=nowhere)
    # Under the limit it is hashed at each start instead (small models cost little).
    assert weights_digest(model, cache_dirs=nowhere, full_hash_limit=_BIG) \
        == weights_digest(model)


def test_no_weight_files_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="weights_revision"):
        weights_digest(tmp_path)


@pytest.mark.slow
def test_one_changed_weight_byte_restores_no_old_block(tiny_copy: Path, tmp_path: Path) -> None:
    """End to end with real engines: KV saved under the weights, one byte of a weight changed
    in place (mtime kept) in the same process, and the next engine restores nothing; with the
    byte put back, the saved blocks restore again (so the store did hold them)."""
    from tests.connector_harness import (
        generate,
        kv_transfer_config,
        open_engine,
        random_prompts,
        scheduler_connector,
        worker_connector,
    )

    prompts = random_prompts(2, [150, 170], seed=5)
    data = tmp_path / "nvme"

    def run(name: str) -> tuple[str, list[int]]:
        store = {"nvme": {"path": str(data), "bytes": 256 << 20}, "name": name}
        with open_engine(tiny_copy, kv_transfer_config(store)) as llm:
            results = generate(llm, prompts, 4)
            if name == "save":
                assert worker_connector().counters()["saved_blocks"] > 0
            return scheduler_connector(llm).fingerprint.hex, [r.num_cached_tokens
                                                             for r in results]

    saved_under, _ = run("save")
    shard = tiny_copy / "model.safetensors"
    _flip_middle_byte_keep_mtime(shard)
    changed, cached = run("changed")
    assert changed != saved_under and cached == [0, 0]
    _flip_middle_byte_keep_mtime(shard)
    again, cached = run("restored")
    assert again == saved_under and all(n > 0 for n in cached)


@pytest.fixture
def tiny_copy(tiny: TinyModel, tmp_path: Path) -> Path:
    """A private copy of the tiny model: this test rewrites its weights."""
    copy = tmp_path / "model"
    shutil.copytree(tiny.path, copy, ignore=shutil.ignore_patterns(CACHE_NAME + "*"))
    return copy
