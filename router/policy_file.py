"""The routing policy as a config file (YAML or JSON), and the command line's overrides of it.
The same file holds the router's trust and bounds settings: `workers.allow` (the worker
allow-list, `router/membership/allowlist.py`) and `limits` (`router/limits.py`).

Like llm-d's EndpointPickerConfig, the file names the parts: soft filters, scorers with their
weights and parameters, the picker, the session rules and every threshold. Each section is
optional; a missing one keeps the preset's (`policy:`, default `kvkeep`). An example with every
key: `deploy/router/policy.yaml`.

    policy: kvkeep                 # the preset the rest adjusts
    sessions: {sticky: true, migrate: true}
    filters: [bounded-load, gpu]              # every placement
    session_filters: [kv-threshold, queue-threshold]   # new sessions and moves, after those
    scorers:
      - {name: precise-prefix, weight: 3}
      - {name: load-aware, weight: 1, parameters: {cap: 128}}
    picker: max-score
    thresholds: {kv_new_session: 0.85, queue_new_session: 32, gpu_max_temp_c: 85}
    workers: {allow: ["10.0.0.0/8:8000", "*.vllm.svc.cluster.local"]}
    limits: {max_sessions: 1000000, max_sessions_per_tenant: 10000}
    tokenize: {mode: worker, timeout_s: 0.25}   # text prompts' ids from a worker's /tokenize

Precedence: preset < file < flags (`--policy` changes the preset under the file,
`--weights` and the threshold flags win over it). Bad input is a `ConfigError` naming the file
and the key.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from kvstore.errors import ConfigError
from router.limits import Limits
from router.membership.allowlist import WorkerAllowList
from router.policy import PolicySpec, ScorerSpec, Thresholds, policy_preset

__all__ = ["PolicyFile", "load_policy_file", "resolve_policy", "resolve_limits"]


def _optional_fields(name: str, cls: type) -> Any:
    """A struct of `cls`'s own fields and types, each optional: one list of names."""
    return msgspec.defstruct(
        name, [(field, kind | None, None) for field, kind in typing.get_type_hints(cls).items()],
        forbid_unknown_fields=True, frozen=True, kw_only=True)


if TYPE_CHECKING:
    _Thresholds = msgspec.Struct
    _Limits = msgspec.Struct
else:
    _Thresholds = _optional_fields("_Thresholds", Thresholds)
    _Limits = _optional_fields("_Limits", Limits)


class _Scorer(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    name: str
    weight: float
    parameters: dict[str, int | float] = {}


class _Sessions(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    sticky: bool | None = None
    migrate: bool | None = None


class _Workers(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    allow: list[str] | None = None


class _Tokenize(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    mode: str | None = None
    timeout_s: float | None = None
    cache_tokens: int | None = None
    retry_after_s: float | None = None


class _File(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    policy: str | None = None
    sessions: _Sessions = _Sessions()
    filters: list[str] | None = None
    session_filters: list[str] | None = None
    scorers: list[_Scorer] | None = None
    picker: str | None = None
    thresholds: _Thresholds | None = None
    workers: _Workers = _Workers()
    limits: _Limits | None = None
    tokenize: _Tokenize | None = None


@dataclass(frozen=True, slots=True)
class PolicyFile:
    """A policy config file as given: `None` (or no threshold) where it says nothing."""

    source: str
    preset: str | None = None
    filters: tuple[str, ...] | None = None
    scorers: tuple[ScorerSpec, ...] | None = None
    picker: str | None = None
    sticky: bool | None = None
    migrate: bool | None = None
    thresholds: Mapping[str, int | float] = dataclasses.field(default_factory=dict)
    workers_allow: tuple[str, ...] | None = None
    limits: Mapping[str, int | float] = dataclasses.field(default_factory=dict)
    tokenize: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    session_filters: tuple[str, ...] | None = None

    def resolve(self, preset: str | None = None) -> PolicySpec:
        """The file over `preset` (default: the file's own `policy:`, else `kvkeep`)."""
        with _context(self.source):
            base = policy_preset(preset or self.preset or "kvkeep")
            changes: dict[str, Any] = {
                k: v for k, v in (("filters", self.filters),
                                  ("session_filters", self.session_filters),
                                  ("scorers", self.scorers),
                                  ("picker", self.picker), ("sticky", self.sticky),
                                  ("migrate", self.migrate)) if v is not None}
            if self.tokenize:
                changes["tokenize"] = replace(base.tokenize, **self.tokenize)
            return replace(base, thresholds=_thresholds(base.thresholds, self.thresholds),
                           **changes)


def load_policy_file(path: str | Path) -> PolicyFile:
    """Read and validate a policy config file (`.json`: JSON; anything else: YAML)."""
    source = str(path)
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"policy config {source}: cannot read it: {exc}") from exc
    decode = msgspec.json.decode if source.endswith(".json") else msgspec.yaml.decode
    try:
        given = decode(raw, type=_File)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise ConfigError(f"policy config {source}: {exc}") from exc
    scorers = None if given.scorers is None else tuple(
        ScorerSpec(s.name, s.weight, tuple(s.parameters.items())) for s in given.scorers)
    allow = given.workers.allow
    spec = PolicyFile(source, given.policy, None if given.filters is None
                      else tuple(given.filters), scorers, given.picker, given.sessions.sticky,
                      given.sessions.migrate, _given(given.thresholds),
                      None if allow is None else tuple(allow), _given(given.limits),
                      _given(given.tokenize),
                      None if given.session_filters is None else tuple(given.session_filters))
    spec.resolve()  # every name and value checked now, not at the first request
    with _context(source):
        if allow is not None:
            WorkerAllowList.parse(allow)
        resolve_limits(spec)
    return spec


def resolve_policy(file: PolicyFile | None = None, *, preset: str | None = None,
                   weights: Mapping[str, float] | None = None,
                   thresholds: Mapping[str, int | float] | None = None) -> PolicySpec:
    """The policy a router runs: `preset` < `file` < `weights` and `thresholds` (the
    command line's flags; a name missing keeps the file's value)."""
    spec = file.resolve(preset) if file is not None else policy_preset(preset or "kvkeep")
    if weights:
        spec = spec.with_weights(weights)
    if thresholds:
        with _context("command line"):
            spec = replace(spec, thresholds=_thresholds(spec.thresholds, thresholds))
    return spec


def resolve_limits(file: PolicyFile | None = None,
                   flags: Mapping[str, int | float] | None = None) -> Limits:
    """The limits a router runs with: the defaults < `file`'s `limits:` < `flags`."""
    values: dict[str, Any] = {**(file.limits if file is not None else {}), **(flags or {})}
    try:
        return Limits(**values)
    except ConfigError as exc:
        raise ConfigError(f"limits.{exc}") from exc


def _given(section: msgspec.Struct | None) -> dict[str, Any]:
    if section is None:
        return {}
    values = msgspec.structs.asdict(section)
    return {name: value for name, value in values.items() if value is not None}


def _thresholds(base: Thresholds, given: Mapping[str, int | float]) -> Thresholds:
    if not given:
        return base
    values: dict[str, Any] = dict(given)
    try:
        return replace(base, **values)
    except ConfigError as exc:  # a value out of range: the message starts with its key
        raise ConfigError(f"thresholds.{exc}") from exc


@contextmanager
def _context(source: str) -> Iterator[None]:
    """Prefixes a `ConfigError` raised inside with where the bad value came from."""
    try:
        yield
    except ConfigError as exc:
        if str(exc).startswith("policy config "):
            raise
        raise ConfigError(f"policy config {source}: {exc}") from exc
