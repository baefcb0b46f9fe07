"""One process's metrics, through prometheus_client: a registry of its own (never the
global default, so several services can share a test process), every metric labelled
with the process's ``instance``, ``role`` and ``model_name``; its exposition; and the
merge of several expositions into one valid one (the gateway's cluster-wide /metrics).

A component declares its metrics on the `Metrics` it is given and names only its own
labels when it updates them. Label values known up front are declared with the metric
(``values=``), so a metric is in the scrape, at zero, before anything happens to it.
Thread-safe: transfers update metrics from their threads.
"""

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import prometheus_client
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

# No `<name>_created` series: they double every counter's and histogram's lines and
# nothing here reads them (Prometheus computes rates from the counters themselves).
prometheus_client.disable_created_metrics()

CONTENT_TYPE = prometheus_client.CONTENT_TYPE_PLAIN_0_0_4  # what every Prometheus since 2.0 reads
IDENTITY_LABELS = ("instance", "role", "model_name")

# Latency buckets, vLLM's where vLLM has the metric (seconds).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0)  # fmt: skip
FAST_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

log = logging.getLogger(__name__)


class Family:
    """A metric whose identity labels are bound: callers give only its own labels,
    in the order it declared them."""

    def __init__(
        self, metric: prometheus_client.metrics.MetricWrapperBase, name: str, labelnames: Sequence[str],
        identity: tuple[str, ...], registry: CollectorRegistry,
    ) -> None:  # fmt: skip
        self._metric = metric
        self._identity = identity
        self._registry = registry
        self.name = name
        self.labelnames = tuple(labelnames)
        # the series `value` reads: a counter's own name (it ends in _total), a histogram's count
        self._read_as = name + "_count" if isinstance(metric, prometheus_client.Histogram) else name

    def labels(self, *values: object):
        """The child for these label values (prometheus_client's Counter/Gauge/Histogram child)."""
        if len(values) != len(self.labelnames):
            raise ValueError(f"{self.name} takes labels {self.labelnames}, got {values}")
        return self._metric.labels(*self._identity, *(str(v) for v in values))

    # label-less metrics
    def inc(self, amount: float = 1.0) -> None:
        self.labels().inc(amount)

    def set(self, value: float) -> None:
        self.labels().set(value)

    def observe(self, value: float) -> None:
        self.labels().observe(value)

    def set_function(self, read: Callable[[], float]) -> None:
        """A gauge read when scraped (``read`` runs on the scraping thread: it reads, never blocks)."""
        self.labels().set_function(read)

    # reading back (tests, and code that reports what it counted)
    def value(self, *values: object) -> float:
        """A counter's or gauge's current value; a histogram's number of observations."""
        own = dict(zip(self.labelnames, (str(v) for v in values)))
        found = self._registry.get_sample_value(self._read_as, {**self._identity_labels(), **own})
        return 0.0 if found is None else found

    def _identity_labels(self) -> dict[str, str]:
        return dict(zip(IDENTITY_LABELS, self._identity))


class Metrics:
    """The metrics of one process: ``instance``, ``role`` and ``model_name`` label
    every metric declared here. Declaring a name twice returns the first declaration
    (two components of one process may share a metric) if it has the same kind and labels."""

    def __init__(self, instance: str = "", role: str = "", model_name: str = "") -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.identity = (instance, role, model_name)
        self._families: dict[str, Family] = {}
        self._functions: dict[str, _ReadOnCollect] = {}

    def counter(self, name: str, help_text: str, labels: Sequence[str] = (), values: Iterable = ()) -> Family:
        """``name`` ends in ``_total``, as Prometheus names counters."""
        if not name.endswith("_total"):
            raise ValueError(f"a counter's name ends in _total: {name}")
        return self._declare(prometheus_client.Counter, name, help_text, labels, values)

    def gauge(self, name: str, help_text: str, labels: Sequence[str] = (), values: Iterable = ()) -> Family:
        return self._declare(prometheus_client.Gauge, name, help_text, labels, values)

    def histogram(
        self, name: str, help_text: str, buckets: Sequence[float], labels: Sequence[str] = (), values: Iterable = ()
    ) -> Family:
        return self._declare(prometheus_client.Histogram, name, help_text, labels, values, buckets=tuple(buckets))

    def _declare(self, kind, name: str, help_text: str, labels: Sequence[str], values: Iterable, **options) -> Family:
        existing = self._families.get(name)
        if existing is not None:
            if not isinstance(existing._metric, kind) or existing.labelnames != tuple(labels):
                raise ValueError(f"{name} is declared twice, differently")
            return existing
        metric = kind(name, help_text, [*IDENTITY_LABELS, *labels], registry=self.registry, **options)
        family = Family(metric, name, labels, self.identity, self.registry)
        self._families[name] = family
        if not labels:
            family.labels()  # in the scrape at zero from the start
        for value in values:
            family.labels(*((value,) if isinstance(value, str) else value))
        return family

    def counter_function(
        self, name: str, help_text: str, read: Callable[[], Mapping[tuple[str, ...], float]], labels: Sequence[str] = ()
    ) -> None:
        """A counter whose values live elsewhere (a component's own tally): ``read``
        returns them by label values when scraped. It runs on the scraping thread: it
        reads, never blocks."""
        self._declare_function("counter", name, help_text, read, labels)

    def gauge_function(
        self, name: str, help_text: str, read: Callable[[], Mapping[tuple[str, ...], float]], labels: Sequence[str] = ()
    ) -> None:
        """A gauge read when scraped, one value per label values (see `counter_function`)."""
        self._declare_function("gauge", name, help_text, read, labels)

    def histogram_function(
        self, name: str, help_text: str,
        read: Callable[[], Mapping[tuple[str, ...], tuple[Sequence[tuple[float, float]], float]]],
        labels: Sequence[str] = (),
    ) -> None:
        """A histogram a component keeps itself: ``read`` returns, by label values, its
        cumulative buckets ``[(upper bound, count), ..., (inf, total)]`` and its sum."""
        self._declare_function("histogram", name, help_text, read, labels)

    def _declare_function(self, kind: str, name: str, help_text: str, read: Callable, labels: Sequence[str]) -> None:
        if kind == "counter" and not name.endswith("_total"):
            raise ValueError(f"a counter's name ends in _total: {name}")
        if name in self._families or name in self._functions:
            raise ValueError(f"{name} is declared twice")
        collector = _ReadOnCollect(kind, name, help_text, [*IDENTITY_LABELS, *labels], self.identity, read)
        self.registry.register(collector)
        self._functions[name] = collector

    def exposition(self) -> str:
        """Every metric, in the Prometheus text format."""
        return generate_latest(self.registry).decode()


class _ReadOnCollect:
    """A collector of one counter or gauge family whose values ``read`` returns when scraped."""

    def __init__(self, kind: str, name: str, help_text: str, labelnames: list[str], identity: tuple, read) -> None:
        self._kind = kind
        self._family = {"gauge": GaugeMetricFamily, "counter": CounterMetricFamily,
                        "histogram": HistogramMetricFamily}[kind]  # fmt: skip
        self._name, self._help, self._labelnames, self._identity, self._read = name, help_text, labelnames, identity, read

    def describe(self):
        return [self._family(self._name, self._help, labels=self._labelnames)]

    def collect(self):
        family = self._family(self._name, self._help, labels=self._labelnames)
        for key, value in self._read().items():
            labels = [*self._identity, *(str(v) for v in key)]
            if self._kind == "histogram":
                buckets, total = value
                family.add_metric(labels, [(floatToGoString(le), n) for le, n in buckets], None)
                # _count and _sum by hand: prometheus_client leaves them out when a bound is
                # negative (OpenMetrics' rule), and a signed error's histogram has such bounds
                plain = dict(zip(self._labelnames, labels))
                family.samples += [Sample(self._name + "_count", plain, buckets[-1][1]),
                                   Sample(self._name + "_sum", plain, total)]  # fmt: skip
            else:
                family.add_metric(labels, value)
        return [family]


@dataclass
class _Parsed:
    """The families of several expositions, as a collector `generate_latest` can render."""

    families: list

    def collect(self):
        return self.families


def merge_expositions(texts: Mapping[str, str]) -> str:
    """Several processes' expositions (by where they came from) as one valid exposition:
    each metric name once, with one HELP and TYPE, and the samples of every process. A
    text that does not parse, or a family whose type (or whose series' names) clash with
    those first seen, is left out and logged; a sample already seen (same name and
    labels) is dropped."""
    families: dict[str, prometheus_client.Metric] = {}
    seen: set[tuple] = set()
    owner: dict[str, str] = {}  # sample name -> the family it belongs to: one family per series name
    for source, text in texts.items():
        try:
            parsed = list(text_string_to_metric_families(text))
        except ValueError as e:
            log.warning("metrics from %s left out: they do not parse (%s)", source, e)
            continue
        for family in parsed:
            kept = families.get(family.name)
            clash = next((owner[s.name] for s in family.samples if owner.get(s.name, family.name) != family.name), None)
            if clash is not None or (kept is not None and kept.type != family.type):
                other = kept.type if kept is not None else f"series of {clash}"
                log.warning("%s from %s left out: a %s here, a %s elsewhere", family.name, source, family.type, other)
                continue
            if kept is None:
                kept = families[family.name] = prometheus_client.Metric(
                    family.name, family.documentation, family.type, family.unit
                )
            for sample in family.samples:
                owner[sample.name] = family.name
                key = (sample.name, tuple(sorted(sample.labels.items())))
                if key not in seen:
                    seen.add(key)
                    kept.samples.append(sample)
    return generate_latest(_Parsed(list(families.values()))).decode()
