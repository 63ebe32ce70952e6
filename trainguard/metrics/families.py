"""Metric families from parts made once: a family's name, help and type (`Spec`), a device's labels (`Labels`).

A collector exports the same series every update (the same GPUs, disks, ranks) with new values. Built with
client_python's `add_metric`, every update makes a label dict per sample, and every scrape sorts and
escapes those labels again. Here the label set of a device is made once, with its exposition text
(exposition.Labels), and a family's name is checked once; an update only pairs label sets with values.
What comes out is an ordinary client_python family (the same class, names and samples `add_metric`
makes), so every reader of families (client_python's encoders, tests) sees no difference.

    UTIL = Spec("gauge", "DCGM_FI_DEV_GPU_UTIL", "GPU utilization (in %).", ["gpu", "UUID"])
    gpu0 = UTIL.labels("0", "GPU-5f3c...")          # once per GPU
    UTIL.family([(gpu0, 97.0), ...])                 # each update

Label sets whose values are only known at update time (a new XID, a rank that appears) come from a
`LabelCache`, which makes each one once.
"""

from __future__ import annotations

from typing import Iterable, Sequence

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.samples import Sample

from trainguard.metrics.exposition import Labels

__all__ = ["Labels", "LabelCache", "Spec", "NO_LABELS"]

_CLASSES = {"gauge": GaugeMetricFamily, "counter": CounterMetricFamily}

# Samples are made straight from their fields, past the namedtuple's Python-level __new__ (half the cost of
# a sample): so the fields must be the ones this code knows.
_SAMPLE_FIELDS = ("name", "labels", "value", "timestamp", "exemplar", "native_histogram")
if Sample._fields != _SAMPLE_FIELDS:
    raise ImportError(f"prometheus_client's Sample has fields {Sample._fields}, trainguard/metrics/families.py knows "
                      f"{_SAMPLE_FIELDS}: update Spec.family")
_new_tuple = tuple.__new__

NO_LABELS = Labels((), ())


class Spec:
    """One family's name, help, type and label names; `family()` makes an update's family from (labels, value)."""

    def __init__(self, kind: str, name: str, documentation: str, label_names: Sequence[str] = ()):
        self._class = _CLASSES[kind]
        template = self._class(name, documentation, labels=list(label_names))   # client_python checks the name
        self.name = template.name                   # a counter's without "_total", as client_python keeps it
        self.sample_name = template.name + "_total" if kind == "counter" else template.name
        self.label_names = tuple(label_names)
        self._attributes = {key: value for key, value in vars(template).items() if key != "samples"}

    def labels(self, *values: str) -> Labels:
        """A label set of this family's label names (make it once per device and keep it)."""
        return Labels(self.label_names, values)

    def family(self, samples: Iterable[tuple[Labels, float]] = ()) -> Metric:
        """A new family with these samples; the same object `_class(...)` plus `add_metric` would make."""
        family = self._class.__new__(self._class)
        family.__dict__.update(self._attributes)
        name = self.sample_name
        family.samples = [_new_tuple(Sample, (name, labels, value, None, None, None)) for labels, value in samples]
        return family

    def value(self, value: float) -> Metric:
        """A family of one unlabelled sample."""
        return self.family(((NO_LABELS, value),))


class LabelCache:
    """Label sets of `names`, made once per distinct values; forgotten all at once past `limit` (series churn)."""

    def __init__(self, names: Sequence[str], limit: int = 4096):
        self.names, self.limit = tuple(names), limit
        self._sets: dict[tuple[str, ...], Labels] = {}

    def get(self, *values: str) -> Labels:
        labels = self._sets.get(values)
        if labels is None:
            if len(self._sets) >= self.limit:
                self._sets.clear()
            labels = self._sets[values] = Labels(self.names, values)
        return labels

