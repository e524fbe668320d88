"""Brief next-token training of the tiny Llama on the local corpus, and held-out prompts.

Why train at all: a random-weight model's next-token distribution is nearly flat, so a KV
perturbation as small as int8 rounding flips near-tied argmaxes and every later greedy token
with them. Judging a lossy KV codec on such a model measures the model's ties, not the codec.
A few hundred steps of cross-entropy on the licence texts the tokenizer was trained on give the
model real preferences (peaked distributions, margins like a trained LM's on common text) at
the cost of seconds, with no download.

Everything is deterministic on a given machine: the seed fixes the initial weights (done by the
builder) and the batch order, and training runs on one thread (a multi-threaded reduction may
sum in another order and change the last bits; those drift through training).

Held-out text: the licences `deploy.local.corpus.HELD_OUT` names are never trained on (see that
module for why those). The tokenizer was trained on every licence, held-out ones included: it
only splits text into tokens; the model's weights never see the held-out text.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from deploy.local.corpus import HELD_OUT, documents

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM

__all__ = ["HELD_OUT", "RECIPE", "TrainingResult", "documents", "heldout_prompts",
           "heldout_tokens", "train_llama"]

SEQ_LEN = 128
BATCH = 16
LR = 3e-3
MIN_LR_FRACTION = 0.1
WARMUP_STEPS = 20
WEIGHT_DECAY = 0.01
CLIP_NORM = 1.0
# Fraction of the token stream held out when the corpus has none of HELD_OUT (fallback text).
_TAIL_FRACTION = 0.1
_EVAL_WINDOWS = 16

# Recorded in the builder's stamp: a change of recipe must rebuild a cached trained model.
RECIPE: dict[str, object] = {
    "seq_len": SEQ_LEN, "batch": BATCH, "lr": LR, "min_lr_fraction": MIN_LR_FRACTION,
    "warmup": WARMUP_STEPS, "weight_decay": WEIGHT_DECAY, "clip": CLIP_NORM,
    "held_out": list(HELD_OUT), "version": 1,
}


@dataclass(frozen=True, slots=True)
class TrainingResult:
    """How training went: losses in nats per token."""

    steps: int
    final_loss: float  # mean training loss over the last 10 steps (one batch is noisy)
    heldout_loss: float  # on windows of the held-out text, after training
    initial_heldout_loss: float  # the same windows before training (for scale)
    seconds: float


def _split(model_dir: Path) -> tuple[list[int], list[int]]:
    """(training tokens, held-out tokens), each one stream of concatenated documents."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    train: list[int] = []
    held: list[int] = []
    for name, text in documents():
        (held if name in HELD_OUT else train).extend(tok.encode(text).ids)
    if not held:  # no licence texts: hold out the tail of the fallback stream
        cut = int(len(train) * (1 - _TAIL_FRACTION))
        train, held = train[:cut], train[cut:]
    return train, held


def heldout_tokens(model_dir: Path | str) -> list[int]:
    """The held-out text of the corpus, tokenized with the model's tokenizer."""
    return _split(Path(model_dir))[1]


def heldout_prompts(model_dir: Path | str, lengths: Sequence[int], *, seed: int
                    ) -> list[list[int]]:
    """One prompt per length: windows of held-out real text at distinct seeded offsets.

    Distinct starts keep two prompts from sharing a first block (which would turn part of the
    comparison into a local prefix-cache hit instead of a restore).
    """
    held = heldout_tokens(model_dir)
    longest = max(lengths)
    if len(held) <= longest + len(lengths):
        raise ValueError(f"held-out text has {len(held)} tokens, prompts need {longest}+")
    starts = random.Random(seed).sample(range(len(held) - longest), len(lengths))
    return [held[s:s + n] for s, n in zip(starts, lengths, strict=True)]


def _windows(stream: list[int], count: int) -> list[list[int]]:
    """Up to `count` evenly spaced, non-overlapping windows of SEQ_LEN tokens."""
    n = min(count, len(stream) // SEQ_LEN)
    step = len(stream) // max(n, 1)
    return [stream[i * step:i * step + SEQ_LEN] for i in range(n)]


def _loss(model: LlamaForCausalLM, windows: list[list[int]]) -> float:
    import torch

    model.train(False)  # eval mode; `model.eval()` is untyped in transformers' annotations
    with torch.no_grad():
        batch = torch.tensor(windows)
        out = model(input_ids=batch, labels=batch)
    model.train()
    return float(out.loss)


def train_llama(model: LlamaForCausalLM, model_dir: Path, *, steps: int, seed: int
                ) -> TrainingResult:
    """Train `model` in place for `steps` AdamW steps of next-token cross-entropy.

    `model_dir` must already hold the tokenizer. Batches are random windows of the training
    stream drawn from a generator seeded with `seed`: a fixed data order.
    """
    import torch

    started = time.perf_counter()
    train, held = _split(model_dir)
    if len(train) <= SEQ_LEN:
        raise ValueError(f"training text has {len(train)} tokens, a window needs {SEQ_LEN}")
    eval_windows = _windows(held, _EVAL_WINDOWS)
    data = torch.tensor(train)
    offsets = torch.arange(SEQ_LEN)
    generator = torch.Generator().manual_seed(seed)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # see the module docstring: one summation order
    try:
        initial = _loss(model, eval_windows)
        decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
        no_decay = [p for n, p in model.named_parameters() if p.dim() < 2 or "embed" in n]
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": WEIGHT_DECAY},
             {"params": no_decay, "weight_decay": 0.0}], lr=LR, betas=(0.9, 0.95))

        def schedule(step: int) -> float:  # linear warm-up, cosine decay to MIN_LR_FRACTION
            if step < WARMUP_STEPS:
                return (step + 1) / WARMUP_STEPS
            progress = (step - WARMUP_STEPS) / max(1, steps - WARMUP_STEPS)
            cosine = 0.5 * (1 + math.cos(math.pi * progress))
            return MIN_LR_FRACTION + (1 - MIN_LR_FRACTION) * cosine

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        model.train()
        losses: list[float] = []
        for _ in range(steps):
            starts = torch.randint(0, len(train) - SEQ_LEN + 1, (BATCH,), generator=generator)
            batch = data[starts[:, None] + offsets]
            # HF shifts the labels inside the loss: inputs and labels are the same window.
            out = model(input_ids=batch, labels=batch)
            optimizer.zero_grad(set_to_none=True)
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_NORM)
            optimizer.step()
            scheduler.step()
            losses.append(float(out.loss.detach()))
        final = _loss(model, eval_windows)
    finally:
        torch.set_num_threads(threads)
    tail = losses[-10:]
    return TrainingResult(steps, sum(tail) / len(tail), final, initial,
                          time.perf_counter() - started)
