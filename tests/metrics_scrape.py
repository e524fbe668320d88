"""Scraping a real component's `/metrics` in tests: every sample by name and labels."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

__all__ = ["Scrape", "scrape", "wait_for_sample"]


@dataclass(frozen=True, slots=True)
class Scrape:
    """One scrape's samples: (sample name, sorted label pairs) -> value."""

    samples: Mapping[tuple[str, tuple[tuple[str, str], ...]], float]
    text: str

    @property
    def names(self) -> set[str]:
        """Every sample name (`x_total`, `x_bucket`, `x_count` ...), as PromQL names them."""
        return {name for name, _ in self.samples}

    def value(self, name: str, **labels: str) -> float:
        """The sum over the samples called `name` whose labels include `labels`; raises
        KeyError if there is none (an absent series is not a 0)."""
        found = [v for (n, pairs), v in self.samples.items()
                 if n == name and labels.items() <= dict(pairs).items()]
        if not found:
            raise KeyError(f"no sample {name}{labels or ''} in the scrape")
        return sum(found)

    def label_values(self, name: str, label: str) -> set[str]:
        return {dict(pairs)[label] for n, pairs in self.samples
                if n == name and label in dict(pairs)}


def scrape(url: str, timeout: float = 10.0) -> Scrape:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        text = resp.read().decode()
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = (sample.name, tuple(sorted(sample.labels.items())))
            samples[key] = samples.get(key, 0.0) + sample.value
    return Scrape(samples, text)


def wait_for_sample(url: str, ready: Callable[[Scrape], bool], timeout: float = 30.0
                    ) -> Scrape:
    """Scrape until `ready(scrape)` holds (a value some background work updates)."""
    deadline = time.monotonic() + timeout
    while True:
        last = scrape(url)
        try:
            if ready(last):
                return last
        except KeyError:
            pass
        if time.monotonic() >= deadline:
            raise AssertionError(f"{url}: condition not met after {timeout}s:\n{last.text[-4000:]}")
        time.sleep(0.2)
