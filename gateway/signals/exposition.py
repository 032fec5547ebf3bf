"""Reading Prometheus exposition text: families by name, sums over label subsets, histograms.

Parsing is prometheus-client's. The rules the servers' formats call for (shared/reference):
never depend on label order, tolerate labels we do not know, and sum a model's series over the
labels that split it (Triton's version and gpu_uuid, vLLM's engine, Kueue's replica_role).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

Labels = Mapping[str, str]


@dataclass(frozen=True, slots=True)
class Exposition:
    families: dict[str, list[tuple[str, dict[str, str], float]]]

    @classmethod
    def parse(cls, text: str) -> Exposition:
        """Raises ValueError on text that is not exposition format."""
        families: dict[str, list[tuple[str, dict[str, str], float]]] = {}
        for family in text_string_to_metric_families(text):
            samples = families.setdefault(family.name, [])
            samples.extend((s.name, dict(s.labels), float(s.value)) for s in family.samples)
        return cls(families)

    def has(self, name: str) -> bool:
        return name in self.families

    def has_series(self, name: str, where: Callable[[Labels], bool]) -> bool:
        """Whether any sample of the family has labels that match."""
        return any(where(labels) for _, labels, _ in self.families.get(name, ()))

    def total(self, name: str, where: Callable[[Labels], bool] = lambda labels: True) -> float | None:
        """The sum of a gauge's or counter's samples whose labels match; None if it is absent, or
        if one of them is not a number (a NaN gauge says it does not know).

        Triton writes counters without `_total`, prometheus-client reads them back with it: both
        spellings are the family's values.
        """
        samples = self.families.get(name)
        if samples is None:
            return None
        values = (name, name + "_total")
        total = sum(value for sample, labels, value in samples if sample in values and where(labels))
        return total if math.isfinite(total) else None

    def histogram_totals(
        self, name: str, where: Callable[[Labels], bool] = lambda labels: True
    ) -> tuple[float, float] | None:
        """A histogram's (sum, count) over the matching series; None if it is absent."""
        samples = self.families.get(name)
        if samples is None:
            return None
        total = count = 0.0
        for sample, labels, value in samples:
            if where(labels):
                if sample == name + "_sum":
                    total += value
                elif sample == name + "_count":
                    count += value
        return (total, count) if math.isfinite(total + count) else None

    def buckets(self, name: str, where: Callable[[Labels], bool]) -> dict[float, float]:
        """A histogram's cumulative buckets by upper bound, summed over the matching series."""
        summed: dict[float, float] = {}
        for sample, labels, value in self.families.get(name, ()):
            if sample == name + "_bucket" and where(labels):
                bound = float(labels["le"])
                summed[bound] = summed.get(bound, 0.0) + value
        return summed
