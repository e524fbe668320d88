"""The int8 codec's greedy token match against bf16, and isolation between models and tenants
sharing one store.

The int8 figures are measured on two models, and both are reported:

- the tiny Llama trained for a few hundred steps on the local licence texts
  (`build_trained_llama("tiny")`), with prompts cut from licences it was never trained on: a model
  with real next-token preferences, the kind a KV codec is judged on;
- the random-weight tiny Llama every other test uses, with random token ids as before. Its
  next-token distributions are nearly flat (about 3 % of its greedy choices win by < 0.02 nats,
  the resolution of bf16 logits), so int8 rounding flips near-ties there and, free-running, one
  flip changes every later token: its free-running figure (~0.6) says more about the model than
  about the codec.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from deploy.local.model import build_trained_llama
from deploy.local.training import heldout_prompts
from tests.connector_harness import (
    BLOCK_SIZE,
    generate,
    kv_transfer_config,
    open_engine,
    random_prompts,
    scheduler_connector,
    worker_connector,
)
from tests.models import TinyModel, build_tiny_llama

pytestmark = pytest.mark.slow

INT8_LENGTHS = [64 + 9 * i for i in range(24)]
INT8_PROMPTS = random_prompts(24, INT8_LENGTHS, seed=31)
INT8_TOKENS = 32
FORCED_EVERY = 4  # teacher-forced points: every 4th position of each reference continuation


@pytest.fixture(scope="module")
def trained() -> TinyModel:
    # The machine-wide cache (~/.cache/kvkeep/models, or $KVKEEP_MODEL_CACHE) that
    # benchmarks.quant (tests/test_benchmark_quant.py) reads too: the same model
    # (TRAINED_SHAPES["tiny"] is build_trained_tiny_llama's), trained once per machine
    # instead of ~60 s in every test session.
    return build_trained_llama("tiny")


def match_rate(got: list[tuple[int, ...]], want: list[tuple[int, ...]]) -> float:
    """Share of generated positions where the greedy token equals the reference's."""
    same = sum(a == b for g, w in zip(got, want, strict=True) for a, b in zip(g, w, strict=True))
    return same / sum(len(w) for w in want)


@dataclass(frozen=True, slots=True)
class Int8Figures:
    """int8-restored greedy decoding against the bf16 reference, for one prompt set."""

    prompts: int
    free_running: float  # positions equal to the reference's, generating INT8_TOKENS freely
    identical: int  # prompts whose whole continuation equals the reference's
    teacher_forced: float  # next token after an int8-restored prefix of the reference
    points: int  # teacher-forced positions
    # The same teacher-forced prompts prefilled in bf16 with no connector: the reference tokens
    # were decoded one at a time, these are prefilled, and bf16 rounding differs between the
    # two. This is the floor below which no codec can be judged; 1.0 means none of it flips.
    bf16_teacher_forced: float

    def properties(self, prefix: str) -> dict[str, float]:
        return {f"{prefix}_free_running_match": self.free_running,
                f"{prefix}_identical_continuations": self.identical / self.prompts,
                f"{prefix}_teacher_forced_match": self.teacher_forced,
                f"{prefix}_bf16_teacher_forced_match": self.bf16_teacher_forced}


def int8_vs_bf16(model: Path, prompt_sets: dict[str, list[list[int]]]) -> dict[str, Int8Figures]:
    """Greedy tokens after int8 restores against a bf16 reference run without the connector.

    Also checks that the reference is not noise: generated twice in its engine, and a third
    time by the int8 engine's first pass (computed in bf16, then saved as int8), it must give
    the same tokens each time.
    """
    with open_engine(model) as llm:
        reference = {name: [r.tokens for r in generate(llm, prompts, INT8_TOKENS)]
                     for name, prompts in prompt_sets.items()}
        llm.reset_prefix_cache()
        for name, prompts in prompt_sets.items():
            assert [r.tokens for r in generate(llm, prompts, INT8_TOKENS)] == reference[name]
        forced = {name: [(list(p) + list(ref[:k]), ref[k])
                         for p, ref in zip(prompt_sets[name], reference[name], strict=True)
                         for k in range(0, INT8_TOKENS, FORCED_EVERY)]
                  for name in prompt_sets}
        llm.reset_prefix_cache()
        control = {name: generate(llm, [prompt for prompt, _ in cases], 1)
                   for name, cases in forced.items()}
    figures: dict[str, Int8Figures] = {}
    config = kv_transfer_config({"host_bytes": 64 << 20, "name": "int8"}, codec="int8")
    with open_engine(model, config) as llm:
        for name, prompts in prompt_sets.items():
            first = generate(llm, prompts, INT8_TOKENS)  # computed in bf16, saved in int8
            assert [r.tokens for r in first] == reference[name]
            llm.reset_prefix_cache()
            restored = generate(llm, prompts, INT8_TOKENS)
            assert [r.num_cached_tokens for r in restored] == [
                (len(p) - 1) // BLOCK_SIZE * BLOCK_SIZE for p in prompts]
            llm.reset_prefix_cache()
            cases = forced[name]
            steps = generate(llm, [prompt for prompt, _ in cases], 1)
            assert all(r.num_cached_tokens == (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE
                       for r, (prompt, _) in zip(steps, cases, strict=True))
            tokens = [r.tokens for r in restored]
            figures[name] = Int8Figures(
                prompts=len(prompts),
                free_running=match_rate(tokens, reference[name]),
                identical=sum(t == w for t, w in zip(tokens, reference[name], strict=True)),
                teacher_forced=sum(r.tokens[0] == want for r, (_, want)
                                   in zip(steps, cases, strict=True)) / len(cases),
                points=len(cases),
                bf16_teacher_forced=sum(r.tokens[0] == want for r, (_, want)
                                        in zip(control[name], cases, strict=True)) / len(cases))
        counters = worker_connector().counters()
        assert counters["load_corrupt"] == 0 and counters["load_mismatch"] == 0
    return figures


def report(model: str, figures: dict[str, Int8Figures],
           record_property: pytest.RecordProperty) -> None:
    for name, f in figures.items():
        for key, value in f.properties(f"{model}_{name}_int8").items():
            record_property(key, round(value, 4))
        print(f"{model} model, {name} prompts: int8 vs bf16 over {f.prompts} prompts: "
              f"free-running match {f.free_running:.3f} ({f.identical} identical), "
              f"teacher-forced {f.teacher_forced:.3f} ({f.points} points; bf16 prefill "
              f"itself {f.bf16_teacher_forced:.3f})")


def test_int8_greedy_token_match(trained: TinyModel, record_property: pytest.RecordProperty
                                 ) -> None:
    """The trained tiny model on 24 held-out text prompts (and on random ids, reported).

    Measured over 3 training seeds x 6 prompt draws (24 prompts, 32 tokens): free-running
    0.92-1.00 (21-24 identical continuations), teacher-forced 0.99-1.00, bf16 floor 1.00.
    The assertions leave margin below those: they hold for a correct codec on this model and
    fail for a broken one (wrong axes or scales garble the KV and the tokens with it).
    """
    heldout = heldout_prompts(trained.path, INT8_LENGTHS, seed=31)
    figures = int8_vs_bf16(trained.path, {"heldout": heldout, "random_ids": INT8_PROMPTS})
    print(f"trained tiny model: final training loss {trained.train_loss:.3f}, "
          f"held-out loss {trained.heldout_loss:.3f} nats/token")
    report("trained", figures, record_property)
    assert figures["heldout"].teacher_forced >= 0.95
    assert figures["heldout"].free_running >= 0.85
    assert figures["random_ids"].teacher_forced >= 0.95


def test_int8_greedy_token_match_random_model(tiny: TinyModel,
                                              record_property: pytest.RecordProperty) -> None:
    """The random-weight model (see the module docstring), on random ids as before, and on the
    trained model's held-out prompts for a like-for-like comparison (reported only).

    Teacher-forced (per-step, no cascade) it measured 0.964 on these prompts and 0.948-0.974
    on held-out text: near-flat distributions make that figure sit close to 95 %, so the 95 %
    target is asserted on the trained model above and this one is held at 90 % (a broken codec
    gives far less); the free-running figure (0.51-0.64) is reported and only held above what
    a broken codec gives.
    """
    heldout = heldout_prompts(tiny.path, INT8_LENGTHS, seed=31)
    figures = int8_vs_bf16(tiny.path, {"heldout": heldout, "random_ids": INT8_PROMPTS})
    report("random", figures, record_property)
    assert figures["random_ids"].teacher_forced >= 0.90
    assert figures["random_ids"].free_running >= 0.4


def test_two_models_and_two_tenants_never_share_blocks(tiny: TinyModel, tmp_path: Path,
                                                       tmp_path_factory: pytest.TempPathFactory
                                                       ) -> None:
    """Same shapes, same prompts, one store: only the exact (model, tenant) gets hits."""
    other = build_tiny_llama(tmp_path_factory.getbasetemp() / "tiny-llama-seed1", seed=1)
    prompts = random_prompts(3, [100, 140, 180], seed=32)
    store = {"nvme": {"path": str(tmp_path / "shared"), "bytes": 64 << 20}}
    with open_engine(tiny.path, kv_transfer_config(store)) as llm:
        generate(llm, prompts, 8)
        first_fp = scheduler_connector(llm).fingerprint
    with open_engine(other.path, kv_transfer_config(store)) as llm:
        results = generate(llm, prompts, 8)
        assert scheduler_connector(llm).fingerprint.digest != first_fp.digest
        assert all(r.num_cached_tokens == 0 for r in results)
        assert scheduler_connector(llm).counters()["lookup_hit_blocks"] == 0
        assert worker_connector().counters()["saved_blocks"] > 0  # it saved its own
    with open_engine(tiny.path, kv_transfer_config(store, tenant="someone-else")) as llm:
        results = generate(llm, prompts, 8)
        assert all(r.num_cached_tokens == 0 for r in results)
    with open_engine(tiny.path, kv_transfer_config(store)) as llm:
        results = generate(llm, prompts, 8)  # the original owner still restores everything
        assert [r.num_cached_tokens for r in results] == [
            (len(p) - 1) // BLOCK_SIZE * BLOCK_SIZE for p in prompts]
