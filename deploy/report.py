"""A run's account: numbered steps printed as they happen, named checks, and a JSON summary.

The demo and chaos runs are read by people (the printed account) and by tests and CI (the
JSON). Both come from the same `Report`, so what a test asserts is what a person read.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

__all__ = ["Check", "Report"]


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    passed: bool
    detail: str


@dataclass
class Report:
    title: str
    out: TextIO = field(default_factory=lambda: sys.stdout)
    checks: list[Check] = field(default_factory=list)
    numbers: dict[str, Any] = field(default_factory=dict)
    started: float = field(default_factory=time.monotonic)
    _step: int = field(init=False, default=0)

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(c.passed for c in self.checks)

    def step(self, title: str) -> None:
        self._step += 1
        self._print(f"\n[{self._elapsed()}] Step {self._step}: {title}")

    def say(self, line: str) -> None:
        self._print(f"[{self._elapsed()}]   {line}")

    def check(self, name: str, passed: bool, detail: str) -> bool:
        self.checks.append(Check(name, passed, detail))
        self._print(f"[{self._elapsed()}]   {'PASS' if passed else 'FAIL'}  {name}: {detail}")
        return passed

    def record(self, **numbers: Any) -> None:
        self.numbers.update(numbers)

    def summary(self) -> None:
        ok = sum(c.passed for c in self.checks)
        self._print(f"\n=== {self.title}: {ok}/{len(self.checks)} checks passed "
                    f"in {time.monotonic() - self.started:.0f}s ===")
        for c in self.checks:
            self._print(f"  {'PASS' if c.passed else 'FAIL'}  {c.name}: {c.detail}")
        if self.numbers:
            self._print("  numbers: " + ", ".join(f"{k}={v}" for k, v in self.numbers.items()))

    def as_dict(self) -> dict[str, Any]:
        return {"title": self.title, "passed": self.passed,
                "seconds": round(time.monotonic() - self.started, 1),
                "checks": [asdict(c) for c in self.checks], "numbers": self.numbers}

    def write_json(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.as_dict(), indent=2, sort_keys=True) + "\n")

    def _elapsed(self) -> str:
        return f"{time.monotonic() - self.started:6.1f}s"

    def _print(self, line: str) -> None:
        print(line, file=self.out, flush=True)
