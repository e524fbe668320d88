"""The local text the tiny models learn from: the licence texts Debian ships.

One module for the corpus, used by both the tokenizer builder (`model.py`) and the training
loop (`training.py`), so neither imports the other for it. Nothing is downloaded: on a machine
without `/usr/share/common-licenses` a built-in paragraph stands in (enough for a 1k vocabulary,
too little to train on well).

Held-out text: whole licences that have no sibling version in the corpus (Apache-2.0, Artistic,
CC0-1.0) are never trained on, so prompts drawn from them are real text the model has not seen.
GPL/LGPL/GFDL would be poor held-out choices: each has near-copies among its other versions.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["LICENCES", "FALLBACK_TEXT", "HELD_OUT", "MIN_CORPUS_CHARS", "tokenizer_texts",
           "documents"]

LICENCES = Path("/usr/share/common-licenses")
# A fallback corpus for machines without Debian's licence texts; enough for a 1k vocabulary.
FALLBACK_TEXT = (
    "the quick brown fox jumps over the lazy dog while a session keeps its cache alive. "
    "a router picks a worker, the worker serves tokens, and the store keeps every block. "
) * 200
# Below this many characters of licence text the fallback paragraph is added.
MIN_CORPUS_CHARS = 50_000
# Licences kept out of training (see the module docstring).
HELD_OUT = ("Apache-2.0", "Artistic", "CC0-1.0")


def _ascii(path: Path) -> str:
    # ASCII only: a vocabulary of printable characters decodes to valid text always.
    return path.read_text(errors="ignore").encode("ascii", "ignore").decode()


def tokenizer_texts() -> list[str]:
    """Every licence file (symlinked versions included, as the tokenizer has always been
    trained: changing this list would change every tiny model's tokenizer), then the fallback
    paragraph if there is too little text."""
    texts: list[str] = []
    if LICENCES.is_dir():
        texts.extend(_ascii(path) for path in sorted(LICENCES.rglob("*")) if path.is_file())
    if sum(map(len, texts)) < MIN_CORPUS_CHARS:
        texts.append(FALLBACK_TEXT)
    return texts


def documents() -> list[tuple[str, str]]:
    """(name, text) of the corpus, each file once: what a model is trained (and held out) on.

    The same files and ASCII filter as `tokenizer_texts`, but symlinks (GPL -> GPL-3 ...) are
    read once: training twice as often on the linked versions would only skew the data.
    """
    docs: list[tuple[str, str]] = []
    seen: set[Path] = set()
    if LICENCES.is_dir():
        for path in sorted(LICENCES.rglob("*")):
            real = path.resolve()
            if path.is_file() and real not in seen:
                seen.add(real)
                docs.append((path.name, _ascii(path)))
    if sum(len(text) for _, text in docs) < MIN_CORPUS_CHARS:
        docs.append(("fallback", FALLBACK_TEXT))
    return docs
