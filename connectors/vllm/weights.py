"""A content digest of a model's weight files that cannot go stale (trust review H6).

The fingerprint used to sample weights over 8 GiB (size, first and last MiB of each file): a
fine-tune that keeps the embeddings and the final norm, i.e. every realistic new checkpoint of
one architecture, kept the old fingerprint and so restored the old weights' KV. Now each file
is named by a digest of all of its bytes, taken from the first source that has one:

1. the digest the file already carries: a Hugging Face cache blob is named by the SHA-256 of
   its content (`.../models--org--name/blobs/<sha256>`, the snapshot's files are symlinks to
   them), so nothing is read. (A safetensors header holds dtypes, shapes and offsets, no
   content digest, so it is no substitute for one.)
2. a full xxh3-128 of the file computed once and cached beside the weights
   (`.kvkeep-weights-digest.json` in the model directory, or, where that is read-only, under
   `~/.cache/kvkeep/weight-digests/`), keyed by the file's size, mtime, ctime, inode and
   device: any write to the file changes its ctime (which, unlike the mtime, no one can set
   back), and a copy or replacement has another inode, so a stale entry is never used.
   Holes of sparse files are hashed as the zeros they read as, without reading them.
3. if neither exists and no cache can be written, weights over FULL_HASH_LIMIT are refused
   (hashing them at every start would read them all each time): the operator pins
   `weights_revision` instead.

The digest is a pure function of file names and contents: two workers with copies of one
model agree on it whatever their paths, inodes or times.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import re
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Final

import xxhash

from kvstore.errors import ConfigError

__all__ = ["WEIGHT_SUFFIXES", "FULL_HASH_LIMIT", "CACHE_NAME", "weights_digest", "file_digest",
           "default_cache_dirs", "checkpoint_kv_scales", "KV_SCALE_SUFFIXES"]

logger = logging.getLogger(__name__)

WEIGHT_SUFFIXES: Final = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
FULL_HASH_LIMIT: Final = 8 << 30
"""Uncached weights above this many bytes are hashed only when the digest can be cached."""
CACHE_NAME: Final = ".kvkeep-weights-digest.json"
_CHUNK: Final = 8 << 20
_ZEROS: Final = memoryview(bytes(_CHUNK))
_HF_BLOB: Final = re.compile(r"[0-9a-f]{64}")


def default_cache_dirs(model_dir: Path) -> list[Path]:
    """Where a computed digest is cached: beside the weights, else in the user's cache."""
    home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    key = xxhash.xxh3_64_hexdigest(str(model_dir.resolve()).encode())
    return [model_dir, home / "kvkeep" / "weight-digests" / key]


def weights_digest(model_dir: Path, *, cache_dirs: Sequence[Path] | None = None,
                   full_hash_limit: int = FULL_HASH_LIMIT) -> str:
    """The digest of every weight file in `model_dir` (see the module doc); ConfigError when
    there are none, or when they cannot be digested without reading them all at each start."""
    files = sorted(p for p in model_dir.iterdir()
                   if p.name.endswith(WEIGHT_SUFFIXES) and p.is_file())
    if not files:
        raise ConfigError(f"no weight files in {model_dir}; set weights_revision in "
                          f"kv_connector_extra_config")
    carried = {p.name: d for p in files if (d := _carried_digest(p)) is not None}
    rest = [p for p in files if p.name not in carried]
    digests = dict(carried)
    if rest:
        digests.update(_cached_full_digests(model_dir, rest,
                                            cache_dirs or default_cache_dirs(model_dir),
                                            full_hash_limit))
    body = ";".join(f"{name}={digests[name]}" for name in sorted(digests))
    return "files-v2:" + xxhash.xxh3_128_hexdigest(body.encode())


def file_digest(path: Path) -> str:
    """The full content digest of one file (xxh3-128; holes read as zeros, never read)."""
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        for start, end, data in _extents(f.fileno()):
            if not data:
                _feed_zeros(h, end - start)
                continue
            f.seek(start)
            left = end - start
            while left > 0:
                chunk = f.read(min(_CHUNK, left))
                if not chunk:  # truncated while we read: the stat key will not match again
                    break
                h.update(chunk)
                left -= len(chunk)
    return "xxh3:" + h.hexdigest()


def _carried_digest(path: Path) -> str | None:
    """The SHA-256 a Hugging Face cache blob is named by (the symlink's target), if it is one."""
    if not path.is_symlink():
        return None
    target = path.resolve()
    if target.parent.name == "blobs" and _HF_BLOB.fullmatch(target.name):
        return "sha256:" + target.name
    return None


def _stat_key(path: Path) -> dict[str, int]:
    st = path.stat()  # of the target: a symlink's own times say nothing about the weights
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns,
            "ino": st.st_ino, "dev": st.st_dev}


def _cached_full_digests(model_dir: Path, files: list[Path], cache_dirs: Sequence[Path],
                         limit: int) -> dict[str, str]:
    for directory in cache_dirs:
        with _locked_cache(directory) as cache:
            if cache is None:
                continue  # not writable: the next place
            entries = _read_cache(cache)
            out: dict[str, str] = {}
            for p in files:
                key = _stat_key(p)
                entry = entries.get(p.name)
                if isinstance(entry, dict) and entry.get("stat") == key \
                        and isinstance(entry.get("digest"), str):
                    out[p.name] = entry["digest"]
                    continue
                logger.info("kvkeep: hashing %s (%.2f GiB) once for the model fingerprint",
                            p, key["size"] / (1 << 30))
                out[p.name] = file_digest(p)
                # The stat after hashing: a write during the hash leaves a key that no later
                # stat matches, so that digest is never reused.
                entries[p.name] = {"stat": key if _stat_key(p) == key else {},
                                   "digest": out[p.name]}
            _write_cache(cache, entries)
            return out
    total = sum(p.stat().st_size for p in files)
    if total > limit:
        raise ConfigError(
            f"kvkeep connector: {total / (1 << 30):.1f} GiB of weights in {model_dir} carry no "
            f"digest (not Hugging Face cache blobs) and there is nowhere to cache a full hash "
            f"({', '.join(map(str, cache_dirs))} not writable), so the fingerprint would read "
            f"them all at every start; set weights_revision in kv_connector_extra_config to "
            f"the checkpoint's revision")
    return {p.name: file_digest(p) for p in files}


@contextlib.contextmanager
def _locked_cache(directory: Path) -> Iterator[Path | None]:
    """The cache file in `directory` under an exclusive lock (the scheduler, the worker and
    other ranks start together: one hashes, the others then read its result), or None when
    the directory cannot hold it."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        lock = os.open(directory / (CACHE_NAME + ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        yield None
        return
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield directory / CACHE_NAME
    finally:
        os.close(lock)


def _read_cache(cache: Path) -> dict[str, Any]:
    try:
        raw = json.loads(cache.read_text())
    except (OSError, ValueError):
        return {}  # absent or torn: hash again
    files = raw.get("files") if isinstance(raw, dict) and raw.get("v") == 1 else None
    return dict(files) if isinstance(files, dict) else {}


def _write_cache(cache: Path, entries: dict[str, Any]) -> None:
    try:
        fd, tmp = tempfile.mkstemp(prefix=CACHE_NAME, dir=cache.parent)
        with os.fdopen(fd, "w") as f:
            json.dump({"v": 1, "files": entries}, f)
        os.replace(tmp, cache)
    except OSError as exc:  # a cache we could lock but not write: hashed again next time
        logger.warning("kvkeep: cannot write the weights digest cache %s: %s", cache, exc)


def _extents(fd: int) -> Iterator[tuple[int, int, bool]]:
    """(start, end, holds_data) runs covering the file, via SEEK_DATA/SEEK_HOLE where the
    file system has them (else one data run)."""
    size = os.fstat(fd).st_size
    pos = 0
    while pos < size:
        try:
            data = os.lseek(fd, pos, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno == errno.ENXIO:  # only a hole from here to the end
                yield pos, size, False
                return
            yield pos, size, True  # no hole support: read it all
            return
        if data > pos:
            yield pos, min(data, size), False
        hole = min(os.lseek(fd, data, os.SEEK_HOLE), size)
        yield data, hole, True
        pos = hole


def _feed_zeros(h: Any, count: int) -> None:
    while count > 0:
        n = min(count, _CHUNK)
        h.update(_ZEROS[:n])
        count -= n


KV_SCALE_SUFFIXES: Final = (".k_scale", ".v_scale", ".kv_scale")


def checkpoint_kv_scales(model_dir: Path | None) -> dict[str, list[float]]:
    """The fp8 KV scales a checkpoint carries (`*.k_scale`, `*.v_scale`, `*.kv_scale`
    tensors of its safetensors files, by name): what vLLM loads into each attention layer's
    `k_scale`/`v_scale`. Empty when there are none (vLLM then uses 1.0) or no directory."""
    if model_dir is None or not model_dir.is_dir():
        return {}
    from safetensors import safe_open

    scales: dict[str, list[float]] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118  (a safe_open handle is not iterable)
                if name.endswith(KV_SCALE_SUFFIXES):
                    scales[name] = [float(x) for x in
                                    f.get_tensor(name).float().reshape(-1).tolist()]
    return scales
