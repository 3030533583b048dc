"""kvbridge's transfer statistics on SGLang's ``/metrics`` (servers started with
``--enable-metrics``).

SGLang serves the metrics of its scheduler processes through prometheus-client's
multiprocess mode: it sets ``PROMETHEUS_MULTIPROC_DIR`` before starting them, metrics
created in a scheduler write there, and the HTTP server's ``/metrics`` aggregates the
directory. kvbridge's metrics are created in the scheduler too (by the manager), so they
appear next to SGLang's own, named ``sglang:kvbridge_<name>`` after the catalogue of
:mod:`kvbridge.runtime.stats` (the same names as vLLM's ``vllm:kvbridge_<name>``),
labelled ``engine_type`` (prefill / decode), ``tp_rank`` and ``transport``.

Who calls: :class:`~kvbridge.adapters.sglang.manager.KVBridgeKVManager` creates one
:class:`PrometheusExport` per rank (:func:`exporter`) and hands it every
:class:`~kvbridge.runtime.stats.StatsSnapshot` it takes, from its transfer, control and
notification threads (prometheus-client metrics are thread-safe). Without
``--enable-metrics`` there is nowhere to export to and :func:`exporter` returns None.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from kvbridge.runtime.stats import (
    BUCKETS,
    COUNTERS,
    GAUGES,
    HISTOGRAMS,
    LIMIT_GAUGES,
    StatsSnapshot,
)

PREFIX = "sglang:kvbridge_"
LABELS = ("engine_type", "tp_rank", "transport")


class PrometheusExport:
    """kvbridge's counters, histograms and gauges for one SGLang rank.

    Args:
        labels: values of :data:`LABELS`.
        registry: prometheus-client registry (default: the process's; in SGLang's
            multiprocess mode the values live in ``PROMETHEUS_MULTIPROC_DIR`` either way).
    """

    def __init__(self, labels: Mapping[str, str], registry=None) -> None:
        from prometheus_client import REGISTRY, Counter, Gauge, Histogram

        registry = REGISTRY if registry is None else registry
        values = [str(labels[name]) for name in LABELS]
        self._counters = {
            name: Counter(f"{PREFIX}{name}", f"kvbridge: {doc}", LABELS, registry=registry).labels(
                *values
            )
            for name, doc in COUNTERS.items()
        }
        self._histograms = {
            key: Histogram(
                f"{PREFIX}{name}", f"kvbridge: {doc}", LABELS, buckets=BUCKETS, registry=registry
            ).labels(*values)
            for key, (name, doc) in HISTOGRAMS.items()
        }
        # multiprocess mode needs a gauge mode: each rank writes its own series (its
        # labels), so "livesum" sums one value per series
        self._gauges = {
            name: Gauge(
                f"{PREFIX}{name}",
                f"kvbridge: {doc}",
                LABELS,
                multiprocess_mode="livesum",
                registry=registry,
            ).labels(*values)
            for name, doc in {**GAUGES, **LIMIT_GAUGES}.items()
        }
        self._levels: dict[str, float] = {}

    def set_levels(self, **levels: float) -> None:
        """Set gauges of :data:`~kvbridge.runtime.stats.GAUGES` and
        :data:`~kvbridge.runtime.stats.LIMIT_GAUGES` (a value that did not change is not
        written again)."""
        for name, value in levels.items():
            if self._levels.get(name) != value:
                self._gauges[name].set(value)
                self._levels[name] = value

    def export(self, snapshot: StatsSnapshot) -> None:
        """Add one snapshot (what was recorded since the previous one), counters in the
        catalogue's order (:data:`~kvbridge.runtime.stats.COUNTERS`: a request's writes
        before the request)."""
        for name, counter in self._counters.items():
            value = getattr(snapshot, name)
            if value:
                counter.inc(value)
        for key, histogram in self._histograms.items():
            for seconds in getattr(snapshot, key):
                histogram.observe(seconds)


def exporter(*, role: str, tp_rank: int, transport: str) -> PrometheusExport | None:
    """The export of one rank when SGLang serves multiprocess metrics (``--enable-metrics``
    sets ``PROMETHEUS_MULTIPROC_DIR`` for its processes), else None."""
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        return None
    return PrometheusExport({"engine_type": role, "tp_rank": str(tp_rank), "transport": transport})


__all__ = ["LABELS", "PREFIX", "PrometheusExport", "exporter"]
