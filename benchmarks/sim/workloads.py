"""The simulated clients: llm-d's shared-prefix ladder, multi-turn chat.

`llmd-shared-prefix` is inference-perf's `shared_prefix` data generator and load generator as
llm-d ran them (inference_perf/datagen/shared_prefix_datagen.py, loadgen/load_generator.py):
150 groups x 5 prompts of a 6000-token system prompt + a 1200-token question, all generated
up front from random token ids and shuffled once; 1000 output tokens, EOS ignored. Stages run
one after another; a stage sends int(rate x duration) requests at Poisson times from one
second after it starts, takes its prompts from index 0 of the shuffled list (i % 750; the load
generator restarts the index per stage), and ends when all of them have finished.

`chat`: sessions arriving at Poisson times, each a number of turns; a turn's prompt is the
previous prompt, its answer and a new user message, sent after an exponential think time. A
few system prompts are shared across sessions.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from benchmarks.sim.tokens import TextRenderer, block_hashes

__all__ = ["Prompt", "RequestSpec", "Stage", "LLMD_STAGES", "SharedPrefixWorkload",
           "ChatWorkload", "Submit", "quick_stages"]

# (QPS, seconds); the first is the warm-up, not reported.
LLMD_STAGES: tuple[tuple[float, float], ...] = (
    (15, 50), (3, 20), (10, 20), (15, 20), (20, 38), (22, 34), (25, 30), (30, 25), (35, 21),
    (40, 38), (43, 36), (46, 33), (49, 30), (52, 29), (55, 27), (57, 26), (60, 25))
# llm-d's per-rate table (guides/optimized-baseline): output tok/s, round robin / llm-d
PUBLISHED_OUTPUT_TOK_S: dict[float, tuple[float, float]] = {
    3: (1797, 1777), 10: (4215, 5066), 15: (5381, 7053), 20: (6205, 11688),
    30: (5702, 13862), 40: (6336, 16041), 60: (6551, 17064)}
PUBLISHED_TTFT_MEAN_S_AT_60 = (75.6, 0.154)


def quick_stages(scale: float = 0.5) -> tuple[tuple[float, float], ...]:
    """The published rates with stage lengths cut by `scale` (the warm-up kept whole: it is
    what fills the caches)."""
    rates = set(PUBLISHED_OUTPUT_TOK_S)
    out = [LLMD_STAGES[0]]
    out += [(r, max(8.0, d * scale)) for r, d in LLMD_STAGES[1:] if r in rates]
    return tuple(out)


@dataclass(slots=True, eq=False)
class Prompt:
    key: int
    tokens: np.ndarray
    hashes: list[int]
    renderer: TextRenderer = field(repr=False)
    _text: str | None = None

    @property
    def text(self) -> str:
        if self._text is None:
            self._text = self.renderer.render(self.tokens)
        return self._text


@dataclass(slots=True, eq=False)
class RequestSpec:
    rid: int
    stage: int
    prompt: Prompt
    output: np.ndarray
    session: str | None = None
    turn: int = 0


@dataclass(frozen=True, slots=True)
class Stage:
    index: int
    rate: float
    duration: float
    warmup: bool


Submit = Callable[[float, RequestSpec], None]


class SharedPrefixWorkload:
    def __init__(self, *, groups: int = 150, prompts_per_group: int = 5,
                 system_tokens: int = 6000, question_tokens: int = 1200,
                 output_tokens: int = 1000, stages: tuple[tuple[float, float], ...] = LLMD_STAGES,
                 vocab: int, block_size: int, seed: int = 0, stage_lead_s: float = 1.0) -> None:
        self.name = "llmd-shared-prefix"
        self.vocab = vocab
        self.output_tokens = output_tokens
        self.stages = [Stage(i, r, d, i == 0) for i, (r, d) in enumerate(stages)]
        self.stage_lead_s = stage_lead_s
        self._rng = np.random.default_rng(seed)
        self._arrivals = random.Random(seed + 1)
        self._seed = seed
        renderer = TextRenderer(vocab)
        prompts: list[Prompt] = []
        for _ in range(groups):
            system = self._rng.integers(0, vocab, system_tokens, dtype=np.int64)
            system_hashes = block_hashes(system, block_size)
            for _ in range(prompts_per_group):
                q = self._rng.integers(0, vocab, question_tokens, dtype=np.int64)
                tokens = np.concatenate((system, q))
                # the system prompt's full blocks are shared; hash only what follows them
                start = len(system_hashes)
                hashes = system_hashes + block_hashes(tokens, block_size, system_hashes[-1]
                                                      if system_hashes else 0, start)
                prompts.append(Prompt(len(prompts), tokens, hashes, renderer))
        random.Random(seed).shuffle(prompts)
        self.prompts = prompts
        self._left: dict[int, int] = {}
        self._next_rid = 0
        self.submit: Submit | None = None
        self.finished_at: dict[int, float] = {}
        self.started_at: dict[int, float] = {}

    def start(self, submit: Submit, now: float) -> None:
        self.submit = submit
        self._run_stage(0, now)

    def finished(self, spec: RequestSpec, now: float) -> None:
        left = self._left[spec.stage] - 1
        self._left[spec.stage] = left
        if left == 0:
            self.finished_at[spec.stage] = now
            if spec.stage + 1 < len(self.stages):
                self._run_stage(spec.stage + 1, now)

    def _run_stage(self, index: int, now: float) -> None:
        assert self.submit is not None
        stage = self.stages[index]
        n = int(stage.rate * stage.duration)
        self._left[index] = n
        self.started_at[index] = now
        t = now + self.stage_lead_s
        for i in range(n):
            t += self._arrivals.expovariate(stage.rate)
            prompt = self.prompts[i % len(self.prompts)]
            self.submit(t, RequestSpec(self._next_rid, index, prompt, self._output()))
            self._next_rid += 1
        if n == 0 and index + 1 < len(self.stages):
            self._run_stage(index + 1, now)

    def _output(self) -> np.ndarray:
        return self._rng.integers(0, self.vocab, self.output_tokens, dtype=np.int64)


class ChatWorkload:
    """Multi-turn chat: `sessions` arriving at `session_rate`, `turns` each."""

    def __init__(self, *, sessions: int = 600, session_rate: float = 3.0, turns: int = 5,
                 system_prompts: int = 8, system_tokens: int = 2000, user_tokens: int = 400,
                 output_tokens: int = 300, think_s: float = 15.0, vocab: int,
                 block_size: int, seed: int = 0) -> None:
        self.name = "chat"
        self.vocab = vocab
        self.block_size = block_size
        self.sessions = sessions
        self.session_rate = session_rate
        self.turns = turns
        self.user_tokens = user_tokens
        self.output_tokens = output_tokens
        self.think_s = think_s
        self.stages = [Stage(0, session_rate, sessions / session_rate, False)]
        self._rng = np.random.default_rng(seed)
        self._times = random.Random(seed + 1)
        self._renderer = TextRenderer(vocab)
        self._systems = [self._rng.integers(0, vocab, system_tokens, dtype=np.int64)
                         for _ in range(system_prompts)]
        self._next_rid = 0
        self._keys = 0
        self.submit: Submit | None = None

    def start(self, submit: Submit, now: float) -> None:
        self.submit = submit
        t = now
        for s in range(self.sessions):
            t += self._times.expovariate(self.session_rate)
            system = self._systems[s % len(self._systems)]
            self._turn(f"chat-{s}", 0, system, t)

    def finished(self, spec: RequestSpec, now: float) -> None:
        if spec.turn + 1 >= self.turns or spec.session is None:
            return
        history = np.concatenate((spec.prompt.tokens, spec.output))
        self._turn(spec.session, spec.turn + 1, history,
                   now + self._times.expovariate(1.0 / self.think_s))

    def _turn(self, session: str, turn: int, history: np.ndarray, at: float) -> None:
        assert self.submit is not None
        user = self._rng.integers(0, self.vocab, self.user_tokens, dtype=np.int64)
        tokens = np.concatenate((history, user))
        self._keys += 1
        prompt = Prompt(self._keys, tokens, [], self._renderer)
        output = self._rng.integers(0, self.vocab, self.output_tokens, dtype=np.int64)
        self.submit(at, RequestSpec(self._next_rid, 0, prompt, output, session, turn))
        self._next_rid += 1
