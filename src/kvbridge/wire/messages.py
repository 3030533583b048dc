"""Messages between kvbridge instances (side channel and transport notifications).

All are frozen msgspec Structs in one tagged union, :data:`Message`. Evolution rule:
new fields get defaults and go at the end; a field's type never changes; a tag is never
reused. Anything else needs a new :data:`~kvbridge.wire.compat.PROTOCOL_VERSION`.

Flows (see DESIGN.md):

- handshake: ``Hello`` -> ``Welcome`` (or the sender gets a decode error naming what
  differs), exchanging identities, transport metadata and cache geometry once per peer;
- layer-wise push: D -> P ``Destination``; P writes layers, each write carrying a
  ``LayerDone`` notification; then P -> D ``Done``;
- P-first: P holds blocks; D -> P ``Pull`` (P writes them into D's blocks, then ``Done``);
- failure: either side ``Abort`` -> ``AbortAck``; ``Heartbeat`` keeps liveness.
"""

from __future__ import annotations

from typing import Union

import msgspec

from kvbridge.core.layout import CacheGeometry
from kvbridge.wire.compat import CompatInfo


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


class Hello(_Msg, tag="hello"):
    """First message on a new connection: who we are and how to reach our KV cache."""

    peer: PeerId
    compat: CompatInfo
    transport: str
    transport_metadata: bytes
    """Opaque to the core; decoded by the named transport's ``add_peer``."""
    geometry: CacheGeometry


class Welcome(_Msg, tag="welcome"):
    """Reply to :class:`Hello`; same content from the other side."""

    peer: PeerId
    compat: CompatInfo
    transport: str
    transport_metadata: bytes
    geometry: CacheGeometry


class Destination(_Msg, tag="dest"):
    """D -> P: where the KV of ``transfer_id`` goes.

    ``block_ids`` are D's blocks for prompt tokens ``[skip_tokens, num_tokens)``; the
    first ``skip_tokens`` (a whole number of blocks) D already has in its prefix cache.
    """

    transfer_id: str
    peer: PeerId
    block_ids: list[int]
    num_tokens: int
    skip_tokens: int = 0


class Pull(_Msg, tag="pull"):
    """D -> P (P-first flow): push the blocks held for ``transfer_id`` into these."""

    transfer_id: str
    peer: PeerId
    block_ids: list[int]
    skip_tokens: int = 0


class LayerDone(_Msg, tag="layer"):
    """P -> D, as the notification of a transfer: ``layers`` of ``transfer_id`` landed."""

    transfer_id: str
    layers: list[int]


class Done(_Msg, tag="done"):
    """P -> D: every block of ``transfer_id`` was written (``ok``), or P gave up."""

    transfer_id: str
    ok: bool = True
    reason: str = ""


class Abort(_Msg, tag="abort"):
    """Either side: stop ``transfer_id``; the receiver releases what it holds for it."""

    transfer_id: str
    reason: str = ""


class AbortAck(_Msg, tag="abort_ack"):
    transfer_id: str


class Heartbeat(_Msg, tag="hb"):
    peer: PeerId


Message = Union[Hello, Welcome, Destination, Pull, LayerDone, Done, Abort, AbortAck, Heartbeat]

__all__ = [
    "Abort",
    "AbortAck",
    "Destination",
    "Done",
    "Heartbeat",
    "Hello",
    "LayerDone",
    "Message",
    "PeerId",
    "Pull",
    "Welcome",
]
