"""Messages between kvbridge instances (side channel and transport notifications).

All are frozen msgspec Structs in one tagged union, :data:`Message`. Evolution rule:
new fields get defaults and go at the end; a field's type never changes; a tag is never
reused. Anything else needs a new :data:`~kvbridge.wire.peer_compat.PROTOCOL_VERSION`.

Directions. The decode side (D) talks to the prefill side (P) over P's side channel;
every such message is a request answered by a :class:`Reply`. P talks to D through
transport notifications, which arrive after the data written with them.

- handshake, D -> P: ``Hello`` -> ``Welcome`` (identities, transport metadata, cache
  geometry; the frame's compatibility hash is checked first);
- layer-wise push: D -> P ``Destination``; P writes layers as they are computed, each
  write carrying a ``LayerDone`` naming the layers and destination blocks it covers, so
  D knows it has everything when the coverage is complete; P -> D ``Done(ok=False)``
  if P gives up;
- P-first: P holds the blocks; D reads them, then D -> P ``Release``;
- either way: D -> P ``Abort``; D -> P ``Heartbeat`` while waiting (the reply carries
  P's epoch, so a restarted P is noticed at once).
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from kvbridge.core.layout import CacheGeometry
from kvbridge.wire.peer_compat import CompatInfo

MAX_BLOCK_IDS = 1 << 20
"""Block ids one list of a message may carry (a prompt of 16M tokens in 16-token blocks).
msgspec checks an array's length from its header, before building it: a peer claiming
more is refused at the cost of reading a few bytes, not of a list of millions of ints."""
MAX_GROUPS = 64
"""KV cache groups after the first in one :class:`Destination`."""
MAX_LAYERS = 1 << 12
"""Layers one :class:`LayerDone` may name."""
MAX_COMPAT_FIELDS = 64
"""Properties a :class:`Reply`'s compatibility digests may name."""

BlockIds = Annotated[list[int], msgspec.Meta(max_length=MAX_BLOCK_IDS)]
Layers = Annotated[list[int], msgspec.Meta(max_length=MAX_LAYERS)]
GroupBlockIds = Annotated[list[BlockIds], msgspec.Meta(max_length=MAX_GROUPS)]


class _Msg(msgspec.Struct, frozen=True, kw_only=True, tag_field="t"):
    """Base of every message: frozen, keyword-only, tagged by field ``t``."""


class PeerId(msgspec.Struct, frozen=True, kw_only=True):
    """Who a peer is: engine instance plus a per-process epoch (a restart is a new
    peer even on the same address), and the rank inside that instance."""

    engine_id: str
    epoch: str
    rank: int = 0

    def __str__(self) -> str:
        return f"{self.engine_id}#{self.epoch}/r{self.rank}"


class StagingInfo(msgspec.Struct, frozen=True, kw_only=True):
    """A registered staging buffer for packed KV (``wire_dtype: fp8``): ``num_slots``
    slots of ``slot_bytes`` from ``base``; one slot holds one block of one layer, packed
    (a chunk of ``csrc/PACKED_FORMAT.md``)."""

    base: int
    num_slots: int
    slot_bytes: int
    memory: str = "host"
    device: int = 0


class Hello(_Msg, tag="hello"):
    """First message on a new connection: who we are and how to reach our KV cache."""

    peer: PeerId
    compat: CompatInfo
    transport: str
    transport_metadata: bytes
    """Opaque to the core; decoded by the named transport's ``add_peer``."""
    geometry: CacheGeometry
    staging: StagingInfo | None = None


class Welcome(_Msg, tag="welcome"):
    """Reply to :class:`Hello`; same content from the other side."""

    peer: PeerId
    compat: CompatInfo
    transport: str
    transport_metadata: bytes
    geometry: CacheGeometry
    staging: StagingInfo | None = None


class Destination(_Msg, tag="dest"):
    """D -> P: where the KV of ``transfer_id`` goes.

    ``block_ids`` are D's blocks for prompt tokens ``[skip_tokens, num_tokens)``, in
    order; the first ``skip_tokens`` (a whole number of blocks) D already has.
    """

    transfer_id: str
    peer: PeerId
    block_ids: BlockIds
    num_tokens: int
    skip_tokens: int = 0
    staging_slot: int = -1
    """Packed KV (``wire_dtype: fp8``): D reserved ``num_layers * len(block_ids)`` chunks
    of its staging buffer from this one, layer-major: layer ``l``'s packed block ``j``
    (of ``block_ids``) goes to chunk ``staging_slot + l * len(block_ids) + j``. A chunk
    is a slot when both sides hold the same heads; otherwise the buffer counts chunks of
    the head range this pair exchanges (see :mod:`kvbridge.runtime.packed`)."""
    source: int = 0
    """Which of D's sources for this transfer the receiving prefill rank is (D reads
    its KV heads from several prefill ranks when the prefill has more TP ranks); P
    echoes it in every ``LayerDone`` and ``Done`` of this destination."""
    group_block_ids: GroupBlockIds = []
    """KV cache groups after the first (vLLM's hybrid manager; peers' ``layer_groups``):
    D's blocks for the same positions, one list per group, -1 where the group holds
    none (``block_ids`` is then group 0's, with -1 too). See :mod:`kvbridge.core.blocks`."""
    ticket: str = ""
    """The transfer's ticket (see :class:`Abort`)."""


class Release(_Msg, tag="release"):
    """D -> P (P-first flow): D has read the blocks held for ``transfer_id`` (or gave
    up, ``ok=False``); P frees them. Either flow: P is a replica D needs nothing from
    (an *idle* prefill rank, :func:`kvbridge.core.tp.idle_prefill_ranks`); P frees them,
    or, not tracking the request yet, frees them as soon as it does."""

    transfer_id: str
    peer: PeerId
    ok: bool = True
    reason: str = ""
    ticket: str = ""
    """The transfer's ticket (see :class:`Abort`)."""


class LayerDone(_Msg, tag="layer"):
    """P -> D, the notification of a write: ``layers`` of destination blocks
    ``block_ids[first_block : first_block + num_blocks]`` of ``transfer_id`` landed."""

    transfer_id: str
    layers: Layers
    first_block: int
    num_blocks: int
    source: int = 0
    """The destination's ``source``."""


class Done(_Msg, tag="done"):
    """P -> D: P will send nothing more for ``transfer_id``; ``ok=False`` says why."""

    transfer_id: str
    ok: bool = True
    reason: str = ""
    source: int = 0
    """The destination's ``source``."""
    aborted: bool = False
    """With ``ok=False``: P's engine ended the request before computing it (its client
    went away), so the decode counts an aborted transfer, not a failed one."""


class Abort(_Msg, tag="abort"):
    """D -> P: stop ``transfer_id`` and release what is held for it.

    ``ticket`` (here, in :class:`Destination` and in :class:`Release`): the unguessable
    token the transfer's handoff gave both sides over HTTP (``kv_transfer_params``: the
    proxy draws it for a pushed request, the prefill for a P-first one). P acts on a
    message for a transfer only when it carries that transfer's ticket, and only from
    the decode instance whose destination it accepted first: a peer that merely knows
    a transfer id can neither take, abort nor release another request's KV.
    """

    transfer_id: str
    peer: PeerId
    reason: str = ""
    ticket: str = ""


class Heartbeat(_Msg, tag="hb"):
    """D -> P while D waits on P; the reply's epoch tells D whether P restarted."""

    peer: PeerId


class Reply(_Msg, tag="reply"):
    """P's answer to every D -> P request.

    ``code``: ``ok``; ``stopped`` (to an Abort: P holds nothing for the transfer and
    will not write, D may reuse its blocks now); ``unknown_peer`` (P has no handshake with this D,
    e.g. P restarted: D must say Hello again); ``unknown_transfer``; ``aborted`` (to a
    Destination: P's engine ended the request before computing it, nothing will be
    written; D fails the load without counting a failure); ``forbidden`` (the message
    does not carry the transfer's ticket, or comes from another decode instance than its
    destination's: nothing changed); ``incompatible`` (``compat``
    carries P's properties, so D's error names what differs); ``error`` (``detail`` says what).
    """

    ok: bool
    code: str = "ok"
    detail: str = ""
    epoch: str = ""
    compat: CompatInfo | None = None
    """To ``incompatible``: P's properties, only to an authenticated peer (with a
    ``secret``); others get :attr:`digests`."""
    salt: bytes = b""
    digests: Annotated[dict[str, str], msgspec.Meta(max_length=MAX_COMPAT_FIELDS)] = {}
    """To ``incompatible``: per property peers must share, a digest of P's value under
    :attr:`salt` (:func:`~kvbridge.wire.peer_compat.compat_digests`): D names the properties
    that differ without learning P's values."""


Message = Hello | Welcome | Destination | Release | LayerDone | Done | Abort | Heartbeat | Reply

__all__ = [
    "MAX_BLOCK_IDS",
    "MAX_GROUPS",
    "MAX_LAYERS",
    "Abort",
    "Destination",
    "Done",
    "Heartbeat",
    "Hello",
    "LayerDone",
    "Message",
    "PeerId",
    "Release",
    "Reply",
    "StagingInfo",
    "Welcome",
]
