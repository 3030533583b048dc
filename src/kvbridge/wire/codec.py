"""Framing and two-phase decoding of kvbridge messages. Never unpickles anything.

A frame is a MessagePack array ``[protocol_version, compat_hash, body]``. Decoding
checks, in order:

1. the frame parses and has that shape (else :class:`~kvbridge.errors.WireError`);
2. the protocol version (else :class:`~kvbridge.errors.ProtocolVersionError`);
3. the compatibility hash (else :class:`~kvbridge.errors.IncompatiblePeerError`, which
   lists the differing properties when the body is a handshake carrying them);
4. only then the body, into the typed :data:`~kvbridge.wire.messages.Message` union.

Who calls: the side channel on every received frame, and the receiving side of a
transport notification. One :class:`Codec` per process (per compatibility class); its
encoder and decoders are created once and reused. msgspec runs with the GIL held, so a
codec may be shared by threads.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from kvbridge.errors import IncompatiblePeerError, ProtocolVersionError, WireError
from kvbridge.wire.messages import MAX_COMPAT_FIELDS, Message
from kvbridge.wire.peer_compat import (
    PROTOCOL_VERSION,
    CompatInfo,
    compat_diff,
    compat_hash,
    digest_diff,
    shared_value,
)

#: Upper bound on a frame kvbridge will try to decode (a handshake with a large
#: geometry is a few KiB; per-request messages are smaller still).
MAX_FRAME_BYTES = 16 << 20


UNDECODABLE = (msgspec.DecodeError, msgspec.ValidationError, RecursionError, MemoryError)
"""What msgspec raises for hostile input: malformed or mistyped bytes, nesting deeper than
the interpreter's recursion limit (msgspec checks it; a body nested ~1,000 levels is 1 KB),
a length prefix that no allocation can honour. Each becomes a :class:`WireError`."""

_MAX_ERROR_CHARS = 300
"""An error text that quotes peer input is cut to this many characters (it is logged and
echoed back to the peer)."""


def _clip(text: str) -> str:
    return text if len(text) <= _MAX_ERROR_CHARS else text[:_MAX_ERROR_CHARS] + "..."


def describe(exc: BaseException) -> str:
    """``exc``'s text, cut to ``_MAX_ERROR_CHARS``: for errors that quote peer input
    (they are logged and may be echoed back)."""
    return _clip(str(exc) or type(exc).__name__)


class _Frame(msgspec.Struct, array_like=True, frozen=True):
    v: int
    compat: str
    body: msgspec.Raw


class _HandshakeCompat(msgspec.Struct):
    """Lenient view of a Hello/Welcome body, or of a ``Reply`` to one: only what explains
    a compat mismatch (a Reply carries the prefill's values only to an authenticated
    peer, to others digests of them)."""

    t: str
    compat: CompatInfo | None = None
    salt: bytes = b""
    digests: Annotated[dict[str, str], msgspec.Meta(max_length=MAX_COMPAT_FIELDS)] = {}


class Codec:
    """Encode and decode :data:`Message` frames for one :class:`CompatInfo`.

    >>> from kvbridge.wire.messages import Done
    >>> info = CompatInfo(model="m", dtype="float32", layout="fused", block_size=32,
    ...                   num_layers=2, num_kv_heads=2, head_dim=64)
    >>> codec = Codec(info)
    >>> codec.decode(codec.encode(Done(transfer_id="r1", ok=False, reason="lease expired")))
    Done(transfer_id='r1', ok=False, reason='lease expired', source=0, aborted=False)
    """

    _frame_encoder = msgspec.msgpack.Encoder()
    _frame_decoder = msgspec.msgpack.Decoder(_Frame)
    _body_decoder = msgspec.msgpack.Decoder(Message)
    _handshake_decoder = msgspec.msgpack.Decoder(_HandshakeCompat)

    def __init__(self, compat: CompatInfo) -> None:
        self.compat = compat
        self.compat_hash = compat_hash(compat)

    def encode(self, msg: Message) -> bytes:
        body = msgspec.Raw(self._frame_encoder.encode(msg))
        return self._frame_encoder.encode(_Frame(PROTOCOL_VERSION, self.compat_hash, body))

    def decode(self, data: bytes | bytearray | memoryview) -> Message:
        """Decode one frame; raises a :class:`WireError` subclass for anything amiss."""
        if len(data) > MAX_FRAME_BYTES:
            raise WireError(f"frame of {len(data)} bytes exceeds the {MAX_FRAME_BYTES}-byte limit")
        try:
            frame = self._frame_decoder.decode(data)
        except UNDECODABLE as exc:
            raise WireError(
                f"undecodable kvbridge frame ({describe(exc)})",
                fix="check that the peer address points at a kvbridge side channel",
            ) from exc
        if frame.v != PROTOCOL_VERSION:
            raise ProtocolVersionError(
                f"peer speaks kvbridge wire protocol {frame.v}, this process speaks "
                f"{PROTOCOL_VERSION}",
                fix="install the same kvbridge version on prefill and decode instances",
            )
        if frame.compat != self.compat_hash:
            raise self._incompatible(frame)
        try:
            return self._body_decoder.decode(frame.body)
        except UNDECODABLE as exc:
            raise WireError(f"malformed kvbridge message from peer: {describe(exc)}") from exc

    def _incompatible(self, frame: _Frame) -> IncompatiblePeerError:
        try:
            view = self._handshake_decoder.decode(frame.body)
        except UNDECODABLE:
            view = None
        if view is not None and view.compat is not None:
            return incompatible(compat_diff(self.compat, view.compat))
        if view is not None and view.digests:
            return incompatible(
                {
                    f: (shared_value(self.compat, f), UNDISCLOSED)
                    for f in digest_diff(self.compat, view.digests, view.salt)
                }
            )
        return IncompatiblePeerError(
            f"peer's KV cache is incompatible (compat hash {frame.compat} != ours "
            f"{self.compat_hash})",
            fix="run prefill and decode with the same model, dtype, block size and parallelism",
        )


UNDISCLOSED = object()
"""A side's value that is not told (only that it differs): a peer that answered with
digests, or, in an error text that travels to an unauthenticated peer, our own."""


def incompatible(
    diffs: dict[str, tuple[object, object]],
    *,
    what: str = "peer's KV cache is incompatible",
    sides: tuple[str, str] = ("ours", "peer"),
) -> IncompatiblePeerError:
    """The one error for two instances whose compatibility info
    (:class:`~kvbridge.wire.peer_compat.CompatInfo`) differs, on either engine: ``what``,
    then each property with the two sides' values (``diffs``: ``{field: (first,
    second)}``, named ``sides``; :data:`UNDISCLOSED` for a value not told), and the fix.
    Raised by :class:`Codec` (a vLLM handshake) and by the SGLang prefill at a decode's
    registration.

    >>> str(incompatible({"block_size": (16, UNDISCLOSED)}))  # doctest: +ELLIPSIS
    "peer's KV cache is incompatible: block_size: ours=16, peer's differs (fix: ... divisor ...)"
    """
    if not diffs:
        detail = "compat hash differs"
    else:
        detail = _clip(
            "; ".join(
                f"{field}: "
                + ", ".join(
                    f"{side}'s differs" if value is UNDISCLOSED else f"{side}={value!r}"
                    for side, value in zip(sides, pair, strict=True)
                )
                for field, pair in diffs.items()
            )
        )
    fix = "start prefill and decode with identical " + (", ".join(diffs) or "cache settings")
    if "block_size" in diffs:
        fix += (
            " (engines with different block sizes: set transfer_block_size to a common "
            "divisor of them, the same on both)"
        )
    return IncompatiblePeerError(
        f"{what}: {detail}",
        differences={
            k: tuple(None if v is UNDISCLOSED else v for v in pair) for k, pair in diffs.items()
        },
        fix=fix,
    )


__all__ = ["MAX_FRAME_BYTES", "UNDECODABLE", "UNDISCLOSED", "Codec", "describe", "incompatible"]
