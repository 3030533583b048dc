"""kvbridge's messages between SGLang prefill and decode ranks. Pure; no I/O.

They travel on SGLang's own control channel (each rank's ZMQ PULL socket, see
:mod:`.manager`) as two frames ``[TAG, msgpack]`` next to SGLang's untagged status,
``ABORT`` and ``ABORT_ACK`` frames; :class:`Done` travels as a transport notification,
delivered only once the data posted with it has landed.

- :class:`Registration` (decode -> prefill, once per peer): the decode rank's transport
  metadata, cache geometry and metadata buffers, and its instance epoch.
- :class:`Destination` (decode -> prefill, per request): the pages and metadata row the
  decode allocated for a room (SGLang's pre-allocation handshake).
- :class:`Done` (prefill -> decode, per request): every page and the metadata row of
  the room have landed.

Network input is decoded into these typed Structs once, at the boundary; a malformed or
foreign message raises :class:`~kvbridge.errors.WireError`.

With a shared ``secret`` (config) every message carries an HMAC-SHA256
(:mod:`kvbridge.wire.auth`): a control message as a third frame over the tag and the
payload, a ``Done`` notification as the payload's last 32 bytes. A message whose MAC is
missing, wrong, or present where this side has no secret raises
:class:`AuthenticationError`, which carries what the message said, unverified.

>>> msg = Destination(room=7, agent="d", ip="127.0.0.1", port=5, pages=encode_pages([3, 4]),
...                   aux_index=1, required_dst_info_num=1)
>>> frames = encode(msg)
>>> frames[0] == TAG
True
>>> got = decode(frames)
>>> got.room, decode_pages(got.pages).tolist()
(7, [3, 4])
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import numpy as np

from kvbridge.adapters.sglang.layout import AuxLayout
from kvbridge.core.layout import CacheGeometry, CacheSpec
from kvbridge.core.states import StateTensor
from kvbridge.errors import WireError
from kvbridge.wire.auth import MAC_BYTES, mac, seal, unseal, verify
from kvbridge.wire.codec import UNDECODABLE, describe
from kvbridge.wire.messages import StagingInfo

PROTOCOL = 1
TAG = b"KVBRIDGE/%d" % PROTOCOL
"""First frame of every kvbridge control message (carries the protocol version)."""


class Registration(msgspec.Struct, frozen=True, kw_only=True, tag="reg"):
    agent: str
    """The decode rank's transport agent name (includes its epoch)."""
    epoch: str
    transport: str
    transport_md: bytes
    geometry: CacheGeometry
    aux: AuxLayout
    ip: str
    port: int
    """The decode rank's control socket (SGLang's ``rank_port``)."""
    wire_dtype: str = "exact"
    staging: StagingInfo | None = None
    """Packed path (``config.packed``): the decode rank's staging buffer (:mod:`.packed`)."""
    packed_spec: CacheSpec | None = None
    """Packed path: the pool as numbers (dtype, heads, head dim); both sides' must be
    equal."""
    data_path: str = "direct"
    """``direct`` or ``packed`` (config ``data_path``, resolved)."""
    tp_size: int = 1
    """The decode's attention TP size; the prefill pairs its heads with the decode
    rank's from it (:func:`.packed.room_part`)."""
    tp_rank: int = 0
    """The decode rank's attention TP rank."""
    kv_heads: int = 0
    """The model's KV heads, all ranks (0: not given)."""
    prefix_cache: bool = False
    """The decode keeps a radix cache of its own (its rooms may start past a hit on
    one of its page boundaries)."""
    page_size: int = 0
    """The decode's ``--page-size`` (its geometry counts transfer pages; 0: not given)."""
    window: CacheGeometry | None = None
    """A hybrid sliding-window pool (:func:`.layout.pool_states`): the window
    layers' pages; ``geometry`` then holds the full-attention layers. None: no window
    layers."""
    states: AuxLayout | None = None
    """A pool with state-space layers (:func:`.layout.pool_states`): their state
    tensors, one row per state slot; ``geometry`` then holds the attention layers.
    None: no state-space layers."""
    state_split: tuple[StateTensor, ...] | None = None
    """With ``states``: how each state tensor's row splits over attention TP ranks
    (:func:`.states.state_split`), for a prefill of another TP size. None: SGLang did
    not say, and the states move between equal TP sizes only."""
    seat: str = ""
    """Which rank of which decode server the agent is (:func:`.compat.server_seat`),
    the same after that server restarts: a registration from a seat a peer already has
    replaces that peer (a restarted rank's old agent). Empty (older decodes): replaces
    nothing."""


class Destination(msgspec.Struct, frozen=True, kw_only=True, tag="dst"):
    room: int
    agent: str
    ip: str
    port: int
    pages: bytes
    """Destination page ids, little-endian int32 (:func:`encode_pages`)."""
    aux_index: int | None
    required_dst_info_num: int
    decode_prefix_len: int | None = None
    is_dummy: bool = False
    staging_first: int | None = None
    """Packed path: the first chunk of the room's run in the decode's staging buffer,
    cut into chunks of the pairing's heads (:mod:`.packed`; ``sources * layers *
    pages`` chunks); None: the decode had no free run, the room fails naming
    ``staging_mb``."""
    window_pages: bytes | None = None
    """A sliding-window pool: the window layers' destination pages of the prompt's last
    window (SGLang's state indices; :func:`encode_pages`), matched by position with the
    prefill's; None: no window layers."""
    state_row: int | None = None
    """A pool with state-space layers: the room's state slot (SGLang's state index),
    whose row of every state tensor the prefill writes after the last chunk; None: no
    state-space layers."""
    nonce: int | None = None
    """Which decode request of the room this is (unique per decode process): a room can
    carry one request after another (SGLang's parallel sampling sends every sample on
    the request's room). The prefill echoes it in :class:`Done`; None from older
    decodes."""


class Done(msgspec.Struct, frozen=True, kw_only=True, tag="done"):
    room: int
    prefill_rank: int
    epoch: str
    bytes: int = 0
    """KV bytes written to this decode for the room (its metrics); 0 from older senders."""
    part: int = 0
    """Packed path: which part of the room's staging run this prefill rank wrote (its
    place among the decode rank's sources, :class:`.packed.Part`)."""
    pages: int = -1
    """How many positions of the room's page list the prefill wrote (the last ones of
    a decode with larger pages than the prefill's may hold no prompt token: the decode
    unpacks only these); -1 from older senders: all."""
    window_first: int = 0
    window_pages: int = -1
    """A sliding-window pool on the packed path: the prefill wrote the window pages
    ``window_first`` to ``window_first + window_pages`` of the room's list (with
    ``transfer_block_size`` the decode's list may start earlier than the prefill's, at
    positions outside the window, or end later; the decode unpacks only these); -1
    from older senders: all."""
    nonce: int | None = None
    """The :attr:`Destination.nonce` this answers: a decode drops a ``Done`` meant for
    an earlier request of the room; None from older senders (not checked)."""


Message = Registration | Destination | Done

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode_pages(pages: Sequence[int] | np.ndarray) -> bytes:
    return np.asarray(pages, dtype="<i4").tobytes()


def decode_pages(data: bytes) -> np.ndarray:
    if len(data) % 4:
        raise WireError(f"page list of {len(data)} bytes is not a list of int32")
    return np.frombuffer(data, dtype="<i4").astype(np.int64)


_AUTH_FIX = "set the same 'secret' in KVBRIDGE_CONFIG on the prefill and decode servers"


class AuthenticationError(WireError):
    """A kvbridge message that failed authentication. ``unverified``: what it said
    (None if it did not decode): trust none of it."""

    def __init__(self, message: str, unverified: Message | None) -> None:
        super().__init__(message, fix=_AUTH_FIX)
        self.unverified = unverified


MAX_UNVERIFIED_BYTES = 1 << 20
"""An unauthenticated payload larger than this is not even read for what it says."""


def _unverified(payload: bytes) -> Message | None:
    if len(payload) > MAX_UNVERIFIED_BYTES:
        return None
    try:
        return _decoder.decode(payload)
    except UNDECODABLE:
        return None


def encode(msg: Message, secret: bytes | None = None) -> list[bytes]:
    """Frames of a control message: ``[TAG, payload]``, plus its MAC with a ``secret``."""
    payload = _encoder.encode(msg)
    return [TAG, payload] if secret is None else [TAG, payload, mac(secret, TAG, payload)]


def encode_payload(msg: Message, secret: bytes | None = None) -> bytes:
    """A notification's payload: the message, followed by its MAC with a ``secret``."""
    return seal(secret, _encoder.encode(msg))


def decode_payload(data: bytes, secret: bytes | None = None) -> Message:
    """Inverse of :func:`encode_payload` with the same ``secret``."""
    body = unseal(secret, data)
    if body is None:
        raise AuthenticationError(
            "a kvbridge notification failed authentication (its sender's secret differs, or it has "
            "none)",
            _unverified(data[:-MAC_BYTES]),
        )
    data = body
    try:
        return _decoder.decode(data)
    except UNDECODABLE as exc:
        raise WireError(f"malformed kvbridge message: {describe(exc)}") from exc


def is_ours(frames: Sequence[bytes]) -> bool:
    return bool(frames) and frames[0].startswith(b"KVBRIDGE/")


def decode(frames: Sequence[bytes], secret: bytes | None = None) -> Message:
    """Decode the frames of :func:`encode` with the same ``secret``; a different
    protocol version is refused by name."""
    if len(frames) not in (2, 3) or not is_ours(frames):
        raise WireError(f"not a kvbridge control message ({len(frames)} frames)")
    if frames[0] != TAG:
        raise WireError(
            f"peer speaks {frames[0].decode(errors='replace')}, this instance {TAG.decode()}: "
            "run the same kvbridge version on prefill and decode"
        )
    if secret is not None and (
        len(frames) != 3 or not verify(secret, frames[2], frames[0], frames[1])
    ):
        why = (
            "carries no MAC (no 'secret' is set there)"
            if len(frames) == 2
            else "has a MAC made with another secret"
        )
        raise AuthenticationError(
            f"a kvbridge control message failed authentication: it {why}", _unverified(frames[1])
        )
    if secret is None and len(frames) == 3:
        raise AuthenticationError(
            "a kvbridge control message carries a MAC, but this instance has no 'secret' to check "
            "it",
            _unverified(frames[1]),
        )
    return decode_payload(frames[1])


__all__ = [
    "PROTOCOL",
    "TAG",
    "AuthenticationError",
    "Destination",
    "Done",
    "Message",
    "Registration",
    "decode",
    "decode_pages",
    "decode_payload",
    "encode",
    "encode_pages",
    "encode_payload",
    "is_ours",
]
