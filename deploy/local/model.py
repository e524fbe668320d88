"""A tiny Llama (random weights, or briefly trained) and its tokenizer, built locally.

The demo and chaos runs need a model that `python -m vllm.entrypoints.openai.api_server`
loads offline on a CPU in seconds. `build_tiny_llama(dir)` writes a Hugging Face model
directory (config, safetensors weights, tokenizer, chat template). The weights come from a
fixed seed, so every worker that builds or loads it computes the same greedy tokens and the
same KV: what failover without recompute, and the demo's text comparison, rely on.

The tokenizer is a byte-level BPE (GPT-2's byte-to-character map) trained on the licence texts
Debian ships (a built-in paragraph elsewhere; `deploy/local/corpus.py`), over an alphabet of
every printable ASCII character plus tab, newline and carriage return. Two properties follow:
- every token is ASCII text, so decoding is plain concatenation (no token holds part of a UTF-8
  character): a stream resumed after any token reads the same;
- structured outputs work: xgrammar (vLLM's guided decoding) reads a byte-level vocabulary
  byte for byte, and every character JSON or a regex can ask for has a token. The tokenizer
  before (format 1: a Metaspace BPE whose alphabet was only the corpus's characters) had no
  `{` or `}` at all, so xgrammar allowed no token for the first character of a json_schema
  request and vLLM failed it ("grammar rejected tokens [0]"); and xgrammar reads a Metaspace
  vocabulary as raw strings, so no token was a space to it and a regex with a space could
  never be met.

The test suite builds its engines' model with this same function (tests/models.py).

`build_trained_tiny_llama(dir)` is the same model trained for a few hundred steps on that corpus
(`deploy/local/training.py`, about 25 s on one CPU thread): what a lossy KV codec is judged on,
since a random model's near-flat next-token distributions flip under any perturbation.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deploy.local.corpus import tokenizer_texts

__all__ = ["TinyModel", "build_tiny_llama", "build_trained_tiny_llama", "build_cached",
           "build_trained_llama", "model_cache_root", "CHAT_TEMPLATE", "TRAINED_INIT_STD",
           "TRAINED_STEPS", "TRAINED_SHAPES"]

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)
# The trained variant: 200 steps reach a held-out loss of ~4.0-4.2 nats (ln 1024 = 6.9 for a
# uniform guess); 300 only overfit the small corpus (held-out loss rises again). It starts from
# the usual 0.02 init: from 0.15 the same steps end at a held-out loss of 5.3.
TRAINED_STEPS = 200
TRAINED_INIT_STD = 0.02
# The trained models a KV codec is judged on: two shapes, so that no scheme is tuned to one.
# "tiny" is the tests' model (2 KV heads of 32); "wide" has more KV heads and head size 128,
# the shape of most real Llamas' heads (its head size is set apart from hidden // heads).
TRAINED_SHAPES: dict[str, dict[str, int]] = {
    "tiny": {"layers": 2, "hidden": 128, "heads": 4, "kv_heads": 2, "intermediate": 256},
    "wide": {"layers": 2, "hidden": 256, "heads": 8, "kv_heads": 4, "head_dim": 128,
             "intermediate": 512},
}
_CACHE_ENV = "KVKEEP_MODEL_CACHE"
_SPECIAL = ["<unk>", "<s>", "</s>", "<pad>"]
_ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>"]
# Tab, newline, carriage return and the printable ASCII range: the tokenizer's base alphabet.
_ASCII_BYTES = frozenset([9, 10, 13, *range(32, 127)])


def _byte_of(char: str) -> int:
    """The byte GPT-2's byte-level map shows as `char` (the inverse of its bytes_to_unicode)."""
    code = ord(char)
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    if code in printable:
        return code
    others = [b for b in range(256) if b not in printable]
    return others[code - 256]


@dataclass(frozen=True, slots=True)
class TinyModel:
    """Where a built model lives and the shape it has."""

    path: Path
    vocab_size: int
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    max_positions: int
    # Set for a trained build (`train_steps` > 0): mean training loss over the last steps and
    # the loss on held-out text, in nats per token. None for the random-weight model.
    train_loss: float | None = None
    heldout_loss: float | None = None
    head_size: int | None = None  # None: hidden // heads

    @property
    def head_dim(self) -> int:
        return self.head_size or self.hidden // self.heads


def _build_tokenizer(out: Path, vocab_size: int) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    # No prefix space: the text a client sends is the text encoded, and xgrammar (which reads
    # the decoder to pick its vocabulary type) sees a plain byte-level vocabulary.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # The alphabet is fixed, not left to the corpus: the licences hold no `{`, `}`, `~`, ...,
    # which JSON and regex outputs need. Non-ASCII bytes stay out (a prompt's non-ASCII text
    # encodes to <unk>), so no token is part of a multi-byte character.
    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    ascii_alphabet = [c for c in byte_chars if _byte_of(c) in _ASCII_BYTES]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=_SPECIAL + _ROLE_TOKENS,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=sorted(ascii_alphabet),  # the corpus (ASCII) adds only form feeds
    )
    tok.train_from_iterator(tokenizer_texts(), trainer=trainer)
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        additional_special_tokens=_ROLE_TOKENS,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return int(tok.get_vocab_size())


def build_tiny_llama(
    directory: Path | str,
    *,
    layers: int = 2,
    hidden: int = 128,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 256,
    vocab_size: int = 1024,
    max_positions: int = 2048,
    init_std: float = 0.15,
    seed: int = 0,
    train_steps: int = 0,
    head_dim: int | None = None,
) -> TinyModel:
    """Write a tiny random Llama (weights, config, tokenizer) into `directory` and describe it.

    Building is idempotent: if `directory` already holds a model built with the same arguments
    (recorded in `kvkeep-tiny.json`), nothing is rebuilt, so a cached build is reused.

    `init_std` 0.15 keeps greedy output varied (the default 0.02 makes a random model repeat one
    token). The head size, `head_dim` or else `hidden // heads`, must be one vLLM's CPU attention
    accepts (32, 64, 128, ...).

    `train_steps` > 0 then trains the random model on the tokenizer's corpus (held-out licences
    excepted; `deploy/local/training.py`): a model with a trained LM's peaked next-token
    distributions, which judging a lossy KV codec needs. Deterministic from `seed`. With the
    default 0 the build (weights and stamp) is exactly the random model's of before.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # no bar in the demo

    out = Path(directory)
    args: dict[str, object] = {
        "layers": layers, "hidden": hidden, "heads": heads, "kv_heads": kv_heads,
        "intermediate": intermediate, "vocab_size": vocab_size, "max_positions": max_positions,
        "init_std": init_std, "seed": seed, "format": 2,  # 2: the byte-level tokenizer
    }
    if head_dim is not None and head_dim != hidden // heads:
        args["head_dim"] = head_dim  # only when it differs: older stamps stay valid
    head_size = head_dim or hidden // heads
    if train_steps:
        from deploy.local.training import RECIPE

        # Only for trained builds: the random model's stamp stays as it was, and so do caches.
        args["train_steps"] = train_steps
        args["recipe"] = RECIPE
    stamp = out / "kvkeep-tiny.json"
    if stamp.exists():
        recorded = json.loads(stamp.read_text())
        if recorded.get("args") == args:
            losses = recorded.get("training", {})
            return TinyModel(out, int(recorded["vocab"]), layers, hidden, heads, kv_heads,
                             max_positions, losses.get("final_loss"), losses.get("heldout_loss"),
                             head_size)
        stamp.unlink()  # a half-rewritten directory must not pass for the old build
    out.mkdir(parents=True, exist_ok=True)
    vocab = _build_tokenizer(out, vocab_size)

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_size,
        max_position_embeddings=max_positions,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        tie_word_embeddings=False,
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)  # type: ignore[no-untyped-call]
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                continue  # RMSNorm weights stay 1
            param.normal_(0.0, init_std, generator=torch.Generator().manual_seed(
                seed + sum(map(ord, name))))
    record: dict[str, object] = {"args": args, "vocab": vocab}
    trained: tuple[float | None, float | None] = (None, None)
    if train_steps:
        from deploy.local.training import train_llama

        result = train_llama(model, out, steps=train_steps, seed=seed)
        record["training"] = {
            "final_loss": result.final_loss, "heldout_loss": result.heldout_loss,
            "initial_heldout_loss": result.initial_heldout_loss,
            "seconds": round(result.seconds, 2)}
        trained = (result.final_loss, result.heldout_loss)
    model.save_pretrained(out, safe_serialization=True)
    stamp.write_text(json.dumps(record))  # last: a build cut short leaves no stamp
    return TinyModel(out, vocab, layers, hidden, heads, kv_heads, max_positions, *trained,
                     head_size)


def build_trained_tiny_llama(directory: Path | str, *, seed: int = 0) -> TinyModel:
    """The default tiny Llama trained for TRAINED_STEPS steps (cached like any build)."""
    return build_tiny_llama(directory, init_std=TRAINED_INIT_STD, train_steps=TRAINED_STEPS,
                            seed=seed)


def model_cache_root() -> Path:
    """Where `build_cached` keeps models: $KVKEEP_MODEL_CACHE, else ~/.cache/kvkeep/models."""
    env = os.environ.get(_CACHE_ENV)
    return Path(env) if env else Path.home() / ".cache" / "kvkeep" / "models"


def build_cached(root: Path | str | None = None, **build_args: Any) -> TinyModel:
    """`build_tiny_llama(**build_args)` in a directory of `root` named by a hash of the
    arguments (and, for trained builds, of the training recipe): each configuration is built
    once per machine and then reused, by any process.

    A build is written into a temporary sibling directory and renamed into place when done, so
    a build cut short or running concurrently in another process never leaves a half-written
    model where a reader looks.
    """
    base = Path(root) if root is not None else model_cache_root()
    key: dict[str, Any] = dict(sorted(build_args.items()))
    if build_args.get("train_steps"):
        from deploy.local.training import RECIPE

        key["recipe"] = RECIPE
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    final = base / f"llama-{digest}"
    if (final / "kvkeep-tiny.json").exists():
        return build_tiny_llama(final, **build_args)  # checks the stamp, builds nothing
    base.mkdir(parents=True, exist_ok=True)
    # One build per configuration at a time: a second process (another test worker) waits for
    # the first's model instead of training its own copy on the same cores. The rename below
    # keeps a reader safe without the lock; the lock only saves the duplicated work.
    with (base / f".{final.name}.lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (final / "kvkeep-tiny.json").exists():
            scratch = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=base))
            try:
                build_tiny_llama(scratch, **build_args)
                try:
                    scratch.rename(final)
                except OSError:  # another process finished first: it built the same model
                    if not (final / "kvkeep-tiny.json").exists():
                        raise
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
    return build_tiny_llama(final, **build_args)


def build_trained_llama(shape: str, root: Path | str | None = None, *, seed: int = 0,
                        steps: int = TRAINED_STEPS) -> TinyModel:
    """One of TRAINED_SHAPES trained for `steps` steps on the local corpus, cached by
    `build_cached`."""
    if shape not in TRAINED_SHAPES:
        raise ValueError(f"unknown model shape {shape!r}; known: {sorted(TRAINED_SHAPES)}")
    return build_cached(root, **TRAINED_SHAPES[shape], init_std=TRAINED_INIT_STD,
                        train_steps=steps, seed=seed)
