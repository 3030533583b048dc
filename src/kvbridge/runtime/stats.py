"""Transfer statistics, engine-agnostic. The sender and receiver record into a
:class:`TransferStats`; engine adapters take a snapshot per reporting interval
(:meth:`TransferStats.take`) and export it their way (vLLM: connector stats and
Prometheus; SGLang: Prometheus in SGLang's multiprocess registry). Thread-safe;
recording is O(1).

:data:`COUNTERS`, :data:`HISTOGRAMS`, :data:`BUCKETS` and :data:`GAUGES` are the Prometheus
catalogue both engines export (each under its own prefix: ``vllm:kvbridge_...``,
``sglang:kvbridge_...``), so one dashboard reads either. :data:`REQUEST_GAUGES` (requests in flight
per phase) come from the runtime's sender and receiver, which the vLLM connector uses; SGLang's own
queue gauges count its rooms."""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass, field


@dataclass
class StatsSnapshot:
    """Everything recorded since the previous snapshot. Plain data (picklable, JSON)."""

    bytes_sent: int = 0
    bytes_received: int = 0
    transfers: int = 0
    """Posted transfers (one per layer group and destination range)."""
    descriptors: int = 0
    layer_writes: int = 0
    """SGLang's prefill, per request sent: its KV writes posted per layer during the forward
    (streaming)."""
    chunk_writes: int = 0
    """SGLang's prefill, per request sent: its KV writes posted per chunk after the chunk's
    forward (every layer of the chunk's pages, or what streaming left)."""
    requests_sent: int = 0
    requests_received: int = 0
    requests_shared: int = 0
    """vLLM's decode scheduler: requests that took the KV another request of the same
    transfer loaded (a request's ``n > 1`` samples) from the prefix cache."""
    failures: int = 0
    leases_expired: int = 0
    aborted: int = 0
    messages_refused: int = 0
    """Peer messages dropped unread or refused: undecodable, failing authentication, over a
    bound, or for a transfer they do not belong to (wrong ticket, another decode instance)."""
    peers_registered: int = 0
    """Peers a rank completed a handshake (vLLM) or registration (SGLang) with: once per
    peer process and rank; a repeated handshake of the same one is not counted."""
    peers_replaced: int = 0
    """Peers dropped for a new process of the same rank (a restart): at its handshake
    (vLLM: same engine and rank with a new epoch, or a new peer on the old one's
    side-channel address; SGLang: the same seat with a new agent), or when a heartbeat
    finds another instance serving the address (vLLM)."""
    transfer_s: list[float] = field(default_factory=list)
    """Per posted transfer: post to completion."""
    exposed_s: list[float] = field(default_factory=list)
    """Per request: prefill compute finished to its last byte landed (what streaming
    did not hide)."""
    request_transfer_s: list[float] = field(default_factory=list)
    """Per request: first post to last completion."""
    staging_slots: int = 0
    """Level of :data:`GAUGES` (the packed path, for adapters that report levels in
    snapshots): the instance's staging slots, all ranks (:meth:`merge` keeps the
    largest); 0: not reported."""
    staging_slots_used: int = 0
    """Level: staging slots held, summed over the ranks reporting (:meth:`merge`)."""
    sends_held: int = 0
    """Level of :data:`REQUEST_GAUGES` (adapters on :mod:`kvbridge.runtime`): prefill
    requests whose blocks are held while the decode side has not yet said where to
    write (push) or read them (pull). Every rank tracks every request, so :meth:`merge`
    keeps the largest."""
    sends_sending: int = 0
    """Level: prefill requests being written to the decode side (largest over ranks)."""
    sends_early: int = 0
    """Level: peer messages a prefill rank keeps for requests it does not track yet
    (bounded: :data:`kvbridge.runtime.sender.MAX_EARLY_TRANSFERS`; largest over ranks)."""
    sends_early_block_ids: int = 0
    """Level: block ids those messages carry (bounded:
    :data:`kvbridge.runtime.sender.MAX_EARLY_BLOCK_IDS`; largest over ranks)."""
    peers: int = 0
    """Level of :data:`LIMIT_GAUGES`: peers this rank keeps a handshake with (largest
    over ranks)."""
    replay_entries: int = 0
    """Level: with a ``secret``, authenticated messages remembered to refuse their
    replays (:class:`kvbridge.wire.auth.ReplayGuard`; largest over ranks)."""
    early_rooms: int = 0
    """Level: SGLang's rooms whose destination came before the prefill's request."""
    receives_allocated: int = 0
    """Level: decode requests whose destination has not reached the prefill side yet
    (staging room, handshake; largest over ranks)."""
    receives_waiting: int = 0
    """Level: decode requests whose destination the prefill side has (or that read
    themselves), waiting for their first KV: the prefill's queue and compute (largest
    over ranks)."""
    receives_receiving: int = 0
    """Level: decode requests whose KV is arriving (largest over ranks)."""

    def to_dict(self) -> dict:
        return asdict(self)

    def merge(self, other: StatsSnapshot) -> StatsSnapshot:
        out = StatsSnapshot()
        for name, value in asdict(self).items():
            other_value = getattr(other, name)
            setattr(
                out, name, max(value, other_value) if name in _MAX_MERGED else value + other_value
            )
        return out

    def is_empty(self) -> bool:
        """Nothing recorded: every counter zero and every histogram empty (levels are
        not recordings)."""
        return not any(
            v
            for k, v in asdict(self).items()
            if k not in GAUGES and k not in REQUEST_GAUGES and k not in LIMIT_GAUGES
        )


class TransferStats:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cur = StatsSnapshot()

    def add(self, **counters: int) -> None:
        with self._lock:
            for name, value in counters.items():
                setattr(self._cur, name, getattr(self._cur, name) + value)

    def observe(self, name: str, seconds: float) -> None:
        with self._lock:
            getattr(self._cur, name).append(seconds)

    def take(self) -> StatsSnapshot:
        with self._lock:
            out, self._cur = self._cur, StatsSnapshot()
        return out


COUNTERS: dict[str, str] = {
    "bytes_sent": "KV bytes written to peers",
    "bytes_received": "KV bytes received from peers",
    "transfers": "Posted KV transfers",
    "layer_writes": (
        "SGLang: KV writes of the requests sent, posted per layer while the prefill computed "
        "(streaming)"
    ),
    "chunk_writes": (
        "SGLang: KV writes of the requests sent, posted per chunk after its forward (not "
        "streamed, or what streaming left)"
    ),
    "requests_sent": "Requests whose KV was sent",
    "requests_received": "Requests whose KV was received",
    "requests_shared": (
        "vLLM: decode requests that read the KV another request of the same transfer loaded "
        "(n > 1's samples) from the prefix cache"
    ),
    "failures": "Failed request transfers",
    "leases_expired": "Held blocks released because the peer never read them",
    "aborted": "Aborted request transfers",
    "messages_refused": (
        "Peer messages dropped or refused: undecodable, unauthenticated, over a bound, or not "
        "the transfer's (wrong ticket or decode instance)"
    ),
    "peers_registered": "Peers a handshake or registration was completed with",
    "peers_replaced": "Peers replaced by a new process of the same rank (a restart)",
}
"""Counter fields of :class:`StatsSnapshot` -> description (exported as ``<name>_total``),
in the order an export adds one snapshot: a request's writes are counted before the request
(``requests_sent``), so a reader that sees a request counted sees its writes too."""

HISTOGRAMS: dict[str, tuple[str, str]] = {
    "transfer_s": ("transfer_seconds", "Posted KV transfers, post to completion"),
    "exposed_s": (
        "exposed_transfer_seconds",
        "Per request: prefill finished to last KV byte landed (not hidden by streaming)",
    ),
    "request_transfer_s": (
        "request_transfer_seconds",
        "Per request: first KV transfer posted to last one completed",
    ),
}
"""Histogram fields of :class:`StatsSnapshot` -> (metric name, description)."""

GAUGES: dict[str, str] = {
    "staging_slots_used": (
        "Staging slots (one packed block of one layer each) held by requests in flight (packed "
        "data path: wire_dtype fp8 or data_path packed)"
    ),
    "staging_slots": (
        "Staging slots of this rank's buffer (packed data path: wire_dtype fp8 or data_path packed)"
    ),
}
"""Levels an adapter reads from its own state: name -> description. The SGLang backend
sets them directly; the vLLM connector reports them in every step's
:class:`StatsSnapshot` (where a worker has a staging buffer), per instance."""

REQUEST_GAUGES: dict[str, str] = {
    "sends_held": (
        "Prefill requests whose KV blocks are held until the decode side says where to write them "
        "(push) or reads them (pull)"
    ),
    "sends_sending": "Prefill requests whose KV is being written to the decode side",
    "sends_early": (
        "Decode messages kept for prefill requests this instance does not track yet (bounded; "
        "a flood of them is refused and counted in messages_refused)"
    ),
    "sends_early_block_ids": (
        "Block ids those kept decode messages carry (bounded; beyond it they are refused and "
        "counted in messages_refused)"
    ),
    "receives_allocated": (
        "Decode requests whose destination has not reached the prefill side yet (staging room, "
        "handshake)"
    ),
    "receives_waiting": (
        "Decode requests waiting for their first KV (the prefill's queue and compute)"
    ),
    "receives_receiving": "Decode requests whose KV is arriving",
}
"""Levels of the transfers in flight by lifecycle phase (:mod:`kvbridge.core.lifecycle`),
for adapters whose transfers run through :class:`~kvbridge.runtime.sender.Sender` and
:class:`~kvbridge.runtime.receiver.Receiver` (vLLM; SGLang's own queue gauges,
``sglang:num_prefill_inflight_queue_reqs`` and the like, count its rooms). Each
worker reports them in every snapshot it returns (:meth:`StatsSnapshot.merge` keeps
the largest over ranks)."""

LIMIT_GAUGES: dict[str, str] = {
    "peers": (
        "Peers this rank keeps a handshake (vLLM) or registration (SGLang) with (bounded; a "
        "peer beyond the bound is refused)"
    ),
    "replay_entries": (
        "With a secret: authenticated messages remembered to refuse their replays (bounded; the "
        "oldest are forgotten first)"
    ),
    "early_rooms": (
        "SGLang: rooms whose decode destination came before the prefill's request (bounded; "
        "dropped after timeouts.lease_s; vLLM counts these in sends_early)"
    ),
}
"""Levels of the per-peer structures a hostile or mistaken peer could grow, each bounded:
name -> description. Both engines export them (vLLM in every step's snapshot, largest
over ranks; SGLang per rank, as :data:`GAUGES`)."""

_MAX_MERGED = frozenset({"staging_slots", *REQUEST_GAUGES, *LIMIT_GAUGES})

BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
"""Histogram buckets, seconds."""


__all__ = [
    "BUCKETS",
    "COUNTERS",
    "GAUGES",
    "HISTOGRAMS",
    "LIMIT_GAUGES",
    "REQUEST_GAUGES",
    "StatsSnapshot",
    "TransferStats",
]
