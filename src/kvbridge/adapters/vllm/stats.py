"""kvbridge's transfer statistics through vLLM's connector stats and Prometheus hooks.

Workers return a :class:`KVBridgeStats` from ``get_kv_connector_stats`` each step they
have something to say; vLLM aggregates them across workers, logs :meth:`reduce` and
feeds the data to :class:`KVBridgePromMetrics`, which exports:

- ``vllm:kvbridge_bytes_sent_total`` / ``..._bytes_received_total``,
- ``vllm:kvbridge_transfers_total``, ``vllm:kvbridge_requests_sent_total`` /
  ``..._received_total``, ``vllm:kvbridge_requests_shared_total`` (counted by the
  scheduler side: a request's ``n > 1`` samples reading the load of the first),
- ``vllm:kvbridge_failures_total``, ``vllm:kvbridge_leases_expired_total``,
  ``vllm:kvbridge_aborted_total``,
- histograms ``vllm:kvbridge_transfer_seconds`` (per posted transfer),
  ``vllm:kvbridge_exposed_transfer_seconds`` (per request: prefill done -> last byte
  landed, what streaming did not hide) and ``vllm:kvbridge_request_transfer_seconds``;
- gauges of the requests in flight by phase: ``vllm:kvbridge_sends_held`` (prefill
  blocks held until the decode side says where to write or reads them),
  ``..._sends_sending``, ``..._receives_allocated`` (decode requests whose destination
  has not reached the prefill yet), ``..._receives_waiting`` (waiting for the first
  KV), ``..._receives_receiving``;
- on the packed path (``wire_dtype: fp8`` or ``data_path: packed``), gauges
  ``vllm:kvbridge_staging_slots`` and ``..._staging_slots_used`` (the instance's staging
  slots and those held, all ranks).

Workers report levels in the steps where one changed or is not zero
(:meth:`~kvbridge.adapters.vllm.worker.WorkerSide.stats`).
"""

from __future__ import annotations

import statistics
from typing import Any

from kvbridge.adapters.vllm.compat import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    create_metric_per_engine,
)
from kvbridge.runtime.stats import (
    BUCKETS,
    COUNTERS,
    GAUGES,
    HISTOGRAMS,
    LIMIT_GAUGES,
    REQUEST_GAUGES,
    StatsSnapshot,
)


class KVBridgeStats(KVConnectorStats):
    """``data`` is a :class:`~kvbridge.runtime.stats.StatsSnapshot` as a dict."""

    def __init__(self, data: dict[str, Any] | None = None) -> None:
        super().__init__(data=dict(data) if data else StatsSnapshot().to_dict())

    def snapshot(self) -> StatsSnapshot:
        return StatsSnapshot(**self.data)

    def reset(self) -> None:
        self.data = StatsSnapshot().to_dict()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if isinstance(other, KVBridgeStats):
            self.data = self.snapshot().merge(other.snapshot()).to_dict()
        return self

    def reduce(self) -> dict[str, int | float]:
        s = self.snapshot()
        out: dict[str, int | float] = {
            "KV sent (MB)": round(s.bytes_sent / 1e6, 3),
            "KV received (MB)": round(s.bytes_received / 1e6, 3),
            "transfers": s.transfers,
            "failures": s.failures,
            "leases expired": s.leases_expired,
        }
        if s.transfer_s:
            out["transfer p50 (ms)"] = round(statistics.median(s.transfer_s) * 1e3, 3)
        if s.exposed_s:
            out["exposed p50 (ms)"] = round(statistics.median(s.exposed_s) * 1e3, 3)
        return out

    def is_empty(self) -> bool:
        return self.snapshot().is_empty()


class KVBridgePromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            name: create_metric_per_engine(
                self._counter_cls(
                    name=f"vllm:kvbridge_{name}",
                    documentation=f"kvbridge: {doc}",
                    labelnames=labelnames,
                ),
                per_engine_labelvalues,
            )
            for name, doc in COUNTERS.items()
        }
        self._histograms = {
            key: create_metric_per_engine(
                self._histogram_cls(
                    name=f"vllm:kvbridge_{name}",
                    documentation=f"kvbridge: {doc}",
                    buckets=list(BUCKETS),
                    labelnames=labelnames,
                ),
                per_engine_labelvalues,
            )
            for key, (name, doc) in HISTOGRAMS.items()
        }

        def gauges(catalogue: dict[str, str]) -> dict[str, dict[int, Any]]:
            return {
                name: create_metric_per_engine(
                    self._gauge_cls(
                        name=f"vllm:kvbridge_{name}",
                        documentation=f"kvbridge: {doc}",
                        labelnames=labelnames,
                        multiprocess_mode="mostrecent",
                    ),
                    per_engine_labelvalues,
                )
                for name, doc in catalogue.items()
            }

        self._gauges = gauges(GAUGES)
        self._request_gauges = gauges({**REQUEST_GAUGES, **LIMIT_GAUGES})

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, metric in self._counters.items():
            value = transfer_stats_data.get(name, 0)
            if value:
                metric[engine_idx].inc(value)
        for key, metric in self._histograms.items():
            for value in transfer_stats_data.get(key, ()):
                metric[engine_idx].observe(value)
        if transfer_stats_data.get("staging_slots"):  # this step's levels (packed instances)
            for name, metric in self._gauges.items():
                metric[engine_idx].set(transfer_stats_data[name])
        # every snapshot carries the request levels; a step without one changed none
        for name, metric in self._request_gauges.items():
            metric[engine_idx].set(transfer_stats_data.get(name, 0))


__all__ = ["KVBridgePromMetrics", "KVBridgeStats"]
