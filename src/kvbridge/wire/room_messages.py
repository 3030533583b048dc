"""The room-addressed messages of kvbridge's SGLang backend, between prefill and decode
ranks, under the wire protocol version of :mod:`kvbridge.wire.peer_compat`. Pure; no I/O.

They travel on SGLang's own control channel (each rank's ZMQ PULL socket, see
:mod:`~kvbridge.adapters.sglang.manager`) as two frames ``[TAG, msgpack]`` next to
SGLang's untagged status, ``ABORT`` and ``ABORT_ACK`` frames; :class:`Done` travels as
a transport notification, delivered only once the data posted with it has landed.

- :class:`Registration` (decode -> prefill, once per peer): the decode rank's transport
  metadata, cache geometry and metadata buffers, and its instance epoch.
- :class:`Destination` (decode -> prefill, per request): the pages and metadata row the
  decode allocated for a room (SGLang's pre-allocation handshake).
- :class:`Done` (prefill -> decode, per request): every page and the metadata row of
  the room have landed.

Network input is decoded into these typed Structs once, at the boundary; a malformed or
foreign message raises :class:`~kvbridge.errors.WireError`.

With a shared ``secret`` (config) every message carries an HMAC-SHA256
(:mod:`kvbridge.wire.auth`) bound to its receiver and a time stamp, and each receiver
refuses a stale or replayed one (:class:`~kvbridge.wire.auth.ReplayGuard`): every message
to a control socket (kvbridge's and SGLang's own frames alike) gets two more frames,
the MAC over the receiver's control endpoint, the stamp and the frames, then the stamp
(:func:`sign`, :func:`unsign`); a ``Done`` notification ends with the stamp and a MAC
over both sides' transport agent names, the stamp and the message. A message whose MAC
is missing, wrong, or present where this side has no secret raises
:class:`AuthenticationError`, which carries what a control message said, unverified.

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
from typing import Annotated

import msgspec
import numpy as np

from kvbridge.core.layout import CacheGeometry, CacheSpec
from kvbridge.core.rows import RowLayout
from kvbridge.core.states import StateTensor
from kvbridge.errors import WireError
from kvbridge.wire.auth import MAC_BYTES, STAMP_BYTES, ReplayGuard, mac, stamp, verify
from kvbridge.wire.codec import UNDECODABLE, describe
from kvbridge.wire.messages import StagingInfo
from kvbridge.wire.peer_compat import PROTOCOL_VERSION, CompatInfo

PROTOCOL = PROTOCOL_VERSION
TAG = b"KVBRIDGE/%d" % PROTOCOL
"""First frame of every kvbridge control message (carries the protocol version)."""


MAX_NAME = 256
"""Characters of a name a message carries (an agent, an epoch, an address, a seat: tens
in practice): a longer one is refused while its header is read."""

Name = Annotated[str, msgspec.Meta(max_length=MAX_NAME)]


class Registration(msgspec.Struct, frozen=True, kw_only=True, tag="reg"):
    agent: Name
    """The decode rank's transport agent name (includes its epoch)."""
    epoch: Name
    transport: Name
    transport_md: bytes
    geometry: CacheGeometry
    aux: RowLayout
    ip: Name
    port: int
    """The decode rank's control socket (SGLang's ``rank_port``)."""
    wire_dtype: str = "exact"
    staging: StagingInfo | None = None
    """Packed path (``config.packed``): the decode rank's staging buffer
    (:mod:`~kvbridge.adapters.sglang.packed`)."""
    packed_spec: CacheSpec | None = None
    """Packed path: the pool as numbers (dtype, heads, head dim); both sides' must be
    equal."""
    data_path: str = "direct"
    """``direct`` or ``packed`` (config ``data_path``, resolved)."""
    tp_size: int = 1
    """The decode's attention TP size; the prefill pairs its heads with the decode
    rank's from it (:func:`~kvbridge.adapters.sglang.packed.room_part`)."""
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
    """A hybrid sliding-window pool
    (:func:`~kvbridge.adapters.sglang.pools.pool_states`): the window layers' pages;
    ``geometry`` then holds the full-attention layers. None: no window layers."""
    states: RowLayout | None = None
    """A pool with state-space layers
    (:func:`~kvbridge.adapters.sglang.pools.pool_states`): their state tensors, one row
    per state slot; ``geometry`` then holds the attention layers. None: no state-space
    layers."""
    state_split: tuple[StateTensor, ...] | None = None
    """With ``states``: how each state tensor's row splits over attention TP ranks
    (:func:`~kvbridge.adapters.sglang.states.state_split`), for a prefill of another TP
    size. None: SGLang did not say, and the states move between equal TP sizes only."""
    compat: CompatInfo | None = None
    """What the decode must share with the prefill (the model, the KV cache's dtype, page
    and shape, the settings that change what moves): the prefill compares its hash with
    its own first, as a vLLM prefill does a ``Hello``'s. None (a decode of an earlier
    kvbridge): refused, naming the fix."""
    seat: Name = ""
    """Which rank of which decode server the agent is
    (:func:`~kvbridge.adapters.sglang.compat.server_seat`), the same after that server
    restarts: a registration from a seat a peer already has replaces that peer (a
    restarted rank's old agent). Empty (older decodes): replaces nothing."""


class Destination(msgspec.Struct, frozen=True, kw_only=True, tag="dst"):
    room: int
    agent: Name
    ip: Name
    port: int
    pages: bytes
    """Destination page ids, little-endian int32 (:func:`encode_pages`)."""
    aux_index: int | None
    required_dst_info_num: int
    decode_prefix_len: int | None = None
    is_dummy: bool = False
    staging_first: int | None = None
    """Packed path: the first chunk of the room's run in the decode's staging buffer,
    cut into chunks of the pairing's heads (:mod:`~kvbridge.adapters.sglang.packed`;
    ``sources * layers * pages`` chunks); None: the decode had no free run, the room
    fails naming ``staging_mb``."""
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
    epoch: Name
    bytes: int = 0
    """KV bytes written to this decode for the room (its metrics); 0 from older senders."""
    part: int = 0
    """Packed path: which part of the room's staging run this prefill rank wrote (its
    place among the decode rank's sources, :class:`~kvbridge.adapters.sglang.packed.Part`)."""
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


_AUTH_FIX = (
    "set the same 'secret' in KVBRIDGE_CONFIG on the prefill and decode servers, and run the "
    "same kvbridge version on both"
)


class AuthenticationError(WireError):
    """A message that failed authentication. ``unverified``: what a kvbridge control
    message whose MAC was missing or wrong said (None if it did not decode, and for a
    stale or replayed one): trust none of it."""

    def __init__(self, message: str, unverified: Message | None) -> None:
        super().__init__(message, fix=_AUTH_FIX)
        self.unverified = unverified


MAX_UNVERIFIED_BYTES = 1 << 20
"""An unauthenticated payload larger than this is not even read for what it says."""

_SIGNED = STAMP_BYTES + MAC_BYTES
"""What :func:`encode_payload` appends with a secret."""


def _unverified(payload: bytes) -> Message | None:
    if len(payload) > MAX_UNVERIFIED_BYTES:
        return None
    try:
        return _decoder.decode(payload)
    except UNDECODABLE:
        return None


def _said(frames: Sequence[bytes]) -> Message | None:
    """What an unauthenticated kvbridge control message says (None for other frames)."""
    return _unverified(frames[1]) if len(frames) >= 2 and frames[0] == TAG else None


def encode(msg: Message) -> list[bytes]:
    """Frames of a control message: ``[TAG, payload]`` (:func:`sign` adds the MAC for
    its receiver when it is sent)."""
    return [TAG, _encoder.encode(msg)]


def _control_parts(receiver: str, when: bytes, frames: Sequence[bytes]) -> tuple[bytes, ...]:
    return (b"sglang-control", receiver.encode(), when, *frames)


def sign(
    frames: Sequence[bytes], secret: bytes | None, receiver: str, when: bytes | None = None
) -> list[bytes]:
    """``frames`` (any message to a control socket: kvbridge's, or SGLang's abort,
    bootstrap and status frames) followed, with a ``secret``, by a MAC over the
    receiver's control endpoint (``tcp://ip:port``), a time stamp and the frames, and
    the stamp. Without a secret, ``frames`` unchanged."""
    frames = list(frames)
    if secret is None:
        return frames
    when = stamp() if when is None else when
    return [*frames, mac(secret, *_control_parts(receiver, when, frames)), when]


def unsign(
    frames: Sequence[bytes], secret: bytes, receiver: str, guard: ReplayGuard
) -> list[bytes]:
    """Inverse of :func:`sign` at the control socket of endpoint ``receiver``: the frames
    it signed, after checking their MAC, then their stamp and that they are new
    (``guard``). Raises :class:`AuthenticationError`: a message without a valid MAC (from
    a peer with another secret or none, or altered, or sent to another receiver), a stale
    or replayed one."""
    if len(frames) < 3 or len(frames[-1]) != STAMP_BYTES or len(frames[-2]) != MAC_BYTES:
        raise AuthenticationError(
            "a message on the control socket failed authentication: it carries no MAC (no "
            "'secret' is set at its sender)",
            _said(frames),
        )
    *body, tag, when = frames
    if not verify(secret, tag, *_control_parts(receiver, when, body)):
        raise AuthenticationError(
            "a message on the control socket failed authentication: it has a MAC made with "
            "another secret, or for another receiver",
            _said(body),
        )
    why = guard.check(tag, when)
    if why is not None:
        raise AuthenticationError(f"a message on the control socket was refused: {why}", None)
    return body


def _note_parts(sender: str, receiver: str, when: bytes, body: bytes) -> tuple[bytes, ...]:
    return (b"sglang-note", sender.encode(), receiver.encode(), when, body)


def encode_payload(
    msg: Message, secret: bytes | None = None, *, sender: str = "", receiver: str = ""
) -> bytes:
    """A notification's payload: the message, followed, with a ``secret``, by a time
    stamp and a MAC over the ``sender``'s and ``receiver``'s transport agent names, the
    stamp and the message."""
    body = _encoder.encode(msg)
    if secret is None:
        return body
    when = stamp()
    return body + when + mac(secret, *_note_parts(sender, receiver, when, body))


def decode_payload(
    data: bytes,
    secret: bytes | None = None,
    *,
    sender: str = "",
    receiver: str = "",
    guard: ReplayGuard | None = None,
) -> Message:
    """Inverse of :func:`encode_payload` with the same ``secret``, for a notification the
    transport says came from agent ``sender`` to us, ``receiver``; with a secret a stale
    or replayed one is refused (``guard``)."""
    if secret is not None:
        body, when, tag = data[:-_SIGNED], data[-_SIGNED:-MAC_BYTES], data[-MAC_BYTES:]
        if len(data) <= _SIGNED or not verify(
            secret, tag, *_note_parts(sender, receiver, when, body)
        ):
            raise AuthenticationError(
                "a kvbridge notification failed authentication (its sender's secret differs, or "
                "it has none, or it was sealed for another sender or receiver)",
                _unverified(body) if len(data) > _SIGNED else None,
            )
        why = None if guard is None else guard.check(tag, when)
        if why is not None:
            raise AuthenticationError(f"a kvbridge notification was refused: {why}", None)
        data = body
    try:
        return _decoder.decode(data)
    except UNDECODABLE as exc:
        raise WireError(f"malformed kvbridge message: {describe(exc)}") from exc


def is_ours(frames: Sequence[bytes]) -> bool:
    return bool(frames) and frames[0].startswith(b"KVBRIDGE/")


def decode(frames: Sequence[bytes]) -> Message:
    """Decode the frames of :func:`encode` (after :func:`unsign` with a secret); a
    different protocol version is refused by name, a signed message (the peer has a
    secret, this instance none) by :class:`AuthenticationError`."""
    if not is_ours(frames):
        raise WireError(f"not a kvbridge control message ({len(frames)} frames)")
    if frames[0] != TAG:
        raise WireError(
            f"peer speaks {frames[0].decode(errors='replace')}, this instance {TAG.decode()}: "
            "run the same kvbridge version on prefill and decode"
        )
    if len(frames) == 4:
        raise AuthenticationError(
            "a kvbridge control message carries a MAC, but this instance has no 'secret' to check "
            "it",
            _said(frames),
        )
    if len(frames) != 2:
        raise WireError(f"not a kvbridge control message ({len(frames)} frames)")
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
    "sign",
    "unsign",
]
