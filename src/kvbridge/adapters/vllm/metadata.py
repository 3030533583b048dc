"""What the scheduler-side connector tells the worker-side connector each step, and
what workers tell the scheduler once at start-up.

Built by :meth:`SchedulerSide.build_meta` once per engine step and bound on every
worker before the forward pass; read-only afterwards. Plain dataclasses: vLLM pickles
them to worker processes (in-process IPC between one engine's own processes, never
network input).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvbridge.adapters.vllm.compat import KVConnectorHandshakeMetadata, KVConnectorMetadata
from kvbridge.adapters.vllm.params import PrefillAddress
from kvbridge.core.blocks import BlockTable


@dataclass
class RecvTask:
    """Decode side: fetch the prompt KV of ``req_id`` into ``block_ids``, from the
    worker of ``prefill`` that has this worker's TP rank."""

    req_id: str
    transfer_id: str
    flow: str
    prefill: PrefillAddress
    block_ids: list[int] | BlockTable
    """Ours for tokens ``[skip_tokens, num_tokens)``; a table of every KV cache group
    with vLLM's hybrid manager."""
    num_tokens: int
    skip_tokens: int
    remote_blocks: list[int] | BlockTable | None = None
    ticket: str = ""
    """The handoff's ticket, sent with every message about the transfer."""


@dataclass
class Forgo:
    """Decode side: ``req_id`` names a transfer it will never load (vLLM computes its
    prompt itself, as for prompt logprobs; or the request ended before admission, e.g.
    rejected by the API server): tell ``prefill``'s workers to let go of
    ``transfer_id`` now rather than when their lease runs out."""

    req_id: str
    transfer_id: str
    prefill: PrefillAddress
    ticket: str = ""
    reason: str = "the decode computes the prompt itself"


@dataclass
class SendStep:
    """Prefill side: ``req_id`` computes prompt tokens ``[computed_before, computed_after)``
    this step. ``new_blocks`` were allocated for it this step (all of them on its first)."""

    req_id: str
    transfer_id: str
    flow: str
    num_tokens: int
    new_blocks: list[int] | BlockTable
    computed_before: int
    computed_after: int
    first: bool
    ticket: str = ""
    """The handoff's ticket (on the first step): the sender refuses messages without it."""

    @property
    def last(self) -> bool:
        return self.computed_after >= self.num_tokens


@dataclass
class KVBridgeMetadata(KVConnectorMetadata):
    recv: list[RecvTask] = field(default_factory=list)
    forgo: list[Forgo] = field(default_factory=list)
    send: list[SendStep] = field(default_factory=list)
    abort_send: dict[str, str] = field(default_factory=dict)
    """req_id -> transfer_id of prefill requests the engine gave up on."""
    abort_recv: dict[str, str] = field(default_factory=dict)
    """req_id -> transfer_id of decode requests the engine gave up on."""
    drop_send: dict[str, str] = field(default_factory=dict)
    """req_id -> transfer_id of prefill requests vLLM preempted: it freed their blocks
    itself, so the workers abort the transfer and never report it as finished."""
    never_sent: dict[str, str] = field(default_factory=dict)
    """transfer_id -> why: pushed prefill requests the engine ended before computing
    them (aborted while queued: their client went away). Nothing is held for them; the
    workers answer their decodes now, which would otherwise wait ``timeouts.receive_s``
    for KV that never comes."""
    idle: bool = False
    """No tokens are computed this step: the engine steps only to poll transfers."""


@dataclass
class KVBridgeHandshake(KVConnectorHandshakeMetadata):
    """One worker's side-channel address, reported to the scheduler at start-up."""

    address: str | None
    epoch: str
    engine_id: str


__all__ = ["Forgo", "KVBridgeHandshake", "KVBridgeMetadata", "RecvTask", "SendStep"]
