"""deploy/local: the corpus module both model builders use, and models cached by config hash."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from deploy.local.corpus import HELD_OUT, documents, tokenizer_texts
from deploy.local.model import build_cached


def test_model_and_training_do_not_import_each_other() -> None:
    """Each imports the corpus, not the other (issue 8 item 7)."""
    for module, other in (("deploy.local.training", "deploy.local.model"),
                          ("deploy.local.model", "deploy.local.training")):
        code = (f"import sys, {module}; assert 'deploy.local.corpus' in sys.modules; "
                f"assert '{other}' not in sys.modules, sorted(sys.modules)")
        subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_corpus() -> None:
    docs = documents()
    names = [name for name, _ in docs]
    assert len(names) == len(set(names)) and all(text.isascii() for _, text in docs)
    assert sum(len(t) for t in tokenizer_texts()) >= sum(len(t) for _, t in docs)
    if Path("/usr/share/common-licenses").is_dir():
        assert set(HELD_OUT) <= set(names)


def test_models_are_cached_by_configuration(tmp_path: Path) -> None:
    first = build_cached(tmp_path, layers=1, hidden=64, heads=2, kv_heads=1,
                         intermediate=64, vocab_size=300)
    stamp = first.path / "kvkeep-tiny.json"
    built = stamp.stat().st_mtime_ns
    again = build_cached(tmp_path, layers=1, hidden=64, heads=2, kv_heads=1,
                         intermediate=64, vocab_size=300)
    assert again == first and stamp.stat().st_mtime_ns == built  # reused, not rebuilt
    other = build_cached(tmp_path, layers=1, hidden=64, heads=2, kv_heads=1, head_dim=64,
                         intermediate=64, vocab_size=300)
    assert other.path != first.path and other.head_dim == 64 and first.head_dim == 32
    # Nothing else, no scratch build left behind; only the builds' lock files beside them.
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == \
        sorted([first.path.name, other.path.name])
