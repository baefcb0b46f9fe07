"""Counters and histograms a process keeps about itself, rendered in the
Prometheus text format. Thread-safe: transfers update them from their threads."""

import bisect
import threading
from collections.abc import Sequence


class _Metric:
    kind = ""

    def __init__(self, name: str, help_text: str, labels: Sequence[str] = ()) -> None:
        self.name = name
        self.help = help_text
        self.labels = tuple(labels)
        self._lock = threading.Lock()

    def _key(self, label_values: Sequence[str]) -> tuple[str, ...]:
        if len(label_values) != len(self.labels):
            raise ValueError(f"{self.name} takes labels {self.labels}")
        return tuple(str(v) for v in label_values)

    def _fmt(self, key: tuple[str, ...], extra: str = "") -> str:
        pairs = [f'{k}="{v}"' for k, v in zip(self.labels, key)]
        if extra:
            pairs.append(extra)
        return "{" + ",".join(pairs) + "}" if pairs else ""


class Counter(_Metric):
    kind = "counter"

    def __init__(self, name: str, help_text: str, labels: Sequence[str] = ()) -> None:
        super().__init__(name, help_text, labels)
        self._values: dict[tuple[str, ...], float] = {}

    def inc(self, *label_values: str, amount: float = 1.0) -> None:
        key = self._key(label_values)
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount

    def value(self, *label_values: str) -> float:
        return self._values.get(self._key(label_values), 0.0)

    def samples(self) -> list[str]:
        with self._lock:
            return [f"{self.name}{self._fmt(k)} {v:g}" for k, v in sorted(self._values.items())]


class Histogram(_Metric):
    kind = "histogram"

    def __init__(self, name: str, help_text: str, buckets: Sequence[float], labels: Sequence[str] = ()) -> None:
        super().__init__(name, help_text, labels)
        self.buckets = sorted(buckets)
        self._counts: dict[tuple[str, ...], list[int]] = {}
        self._sums: dict[tuple[str, ...], float] = {}

    def observe(self, value: float, *label_values: str) -> None:
        key = self._key(label_values)
        with self._lock:
            counts = self._counts.setdefault(key, [0] * (len(self.buckets) + 1))
            counts[bisect.bisect_left(self.buckets, value)] += 1
            self._sums[key] = self._sums.get(key, 0.0) + value

    def count(self, *label_values: str) -> int:
        return sum(self._counts.get(self._key(label_values), []))

    def samples(self) -> list[str]:
        lines = []
        with self._lock:
            for key, counts in sorted(self._counts.items()):
                running = 0
                for bound, n in zip([*self.buckets, float("inf")], counts):
                    running += n
                    le = "+Inf" if bound == float("inf") else f"{bound:g}"
                    labels = self._fmt(key, 'le="' + le + '"')
                    lines.append(f"{self.name}_bucket{labels} {running}")
                lines.append(f"{self.name}_sum{self._fmt(key)} {self._sums[key]:g}")
                lines.append(f"{self.name}_count{self._fmt(key)} {running}")
        return lines


class Registry:
    def __init__(self) -> None:
        self._metrics: dict[str, _Metric] = {}

    def counter(self, name: str, help_text: str, labels: Sequence[str] = ()) -> Counter:
        return self._add(Counter(name, help_text, labels))

    def histogram(self, name: str, help_text: str, buckets: Sequence[float], labels: Sequence[str] = ()) -> Histogram:
        return self._add(Histogram(name, help_text, buckets, labels))

    def _add(self, metric):
        existing = self._metrics.get(metric.name)
        if existing is not None:
            return existing
        self._metrics[metric.name] = metric
        return metric

    def render(self) -> str:
        lines = []
        for metric in self._metrics.values():
            lines += [f"# HELP {metric.name} {metric.help}", f"# TYPE {metric.name} {metric.kind}", *metric.samples()]
        return "\n".join(lines) + "\n"


REGISTRY = Registry()  # the process's own metrics


def merge_by_instance(texts: dict[str, str]) -> str:
    """Several processes' expositions as one: every sample gains an ``instance``
    label, and each metric's HELP/TYPE lines appear once, before its samples."""
    order: list[str] = []
    header: dict[str, list[str]] = {}
    samples: dict[str, list[str]] = {}
    for instance, text in texts.items():
        current = None
        for line in text.splitlines():
            if line.startswith("# "):
                parts = line.split(" ", 3)
                current = parts[2]
                if current not in header:
                    order.append(current)
                    header[current], samples[current] = [], []
                if line not in header[current]:
                    header[current].append(line)
            elif line and current is not None:
                name, _, rest = line.partition(" ")
                if "{" in name:
                    name = name.replace("{", '{instance="' + instance + '",', 1)
                else:
                    name = name + '{instance="' + instance + '"}'
                samples[current].append(f"{name} {rest}")
    lines = []
    for metric in order:
        lines += header[metric] + samples[metric]
    return "\n".join(lines) + "\n"
