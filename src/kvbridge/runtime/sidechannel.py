"""The side channel: small control messages between instances, over ZeroMQ.

The prefill side serves a :class:`SideChannelServer` (one ROUTER socket, one thread);
the decode side sends it requests through a :class:`SideChannelClient` (one DEALER
socket per server address) and gets a :class:`~kvbridge.wire.messages.Reply` (or a
``Welcome``) back. Every request has a deadline.

Frames: ``[request id, kvbridge frame]``. With a shared secret, two more: an
HMAC-SHA256 over the server's address, a time stamp, the request id and the frame, and
the stamp. The server checks the MAC before decoding anything, refuses a stamp more
than :data:`~kvbridge.wire.auth.FRESH_S` away from its clock and a MAC it has seen
before (:class:`~kvbridge.wire.auth.ReplayGuard`), so a captured request can be
replayed neither later, nor again, nor to another server with the same secret (the
sender's identity and epoch are inside the frame). A reply's MAC covers the
request's MAC and the reply. A frame that fails authentication or decoding is answered
with an error and never acted on; a peer of another compatibility class is told which
properties differ, not our values (unless it is authenticated). Replies echo the
request id, so a reply that arrives after its request timed out is recognised and
dropped. Every connection has read
deadlines (:mod:`kvbridge.transports.zmqlimits`): a peer that stalls mid-message is
disconnected and its partial message dropped.

Threads: the server runs the handler on its own thread, one request at a time; keep
handlers short. Client methods may be called from any thread (one lock per address).
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import threading
import time
from collections.abc import Callable

import zmq

from kvbridge.errors import IncompatiblePeerError, KVBridgeError, PeerUnreachableError, WireError
from kvbridge.transports.zmqlimits import limit_socket
from kvbridge.wire.auth import ReplayGuard, mac, stamp, verify
from kvbridge.wire.codec import MAX_FRAME_BYTES, Codec
from kvbridge.wire.messages import Message, Reply
from kvbridge.wire.peer_compat import compat_digests

log = logging.getLogger(__name__)

Handler = Callable[[Message], Message]

_MAX_RID_BYTES = 64
"""A request id is a client's counter; a longer one is not a kvbridge client's."""


def _request_parts(address: str, stamp: bytes, rid: bytes, payload: bytes) -> tuple[bytes, ...]:
    """What a request's MAC covers (:func:`kvbridge.wire.auth.mac`)."""
    return (b"request", address.encode(), stamp, rid, payload)


def listening(address: str, timeout: float = 1.0) -> bool:
    """Whether a process still listens at a ``tcp://host:port`` side-channel address.

    A TCP connect is accepted by the kernel (and libzmq's I/O thread) even while the
    server's Python thread is busy, e.g. holding the GIL through a compilation, and is
    refused at once when the process is gone: this tells a slow peer from a dead one.
    """
    if not address.startswith("tcp://"):
        return True  # no cheap probe: assume alive, the caller's deadlines still apply
    host, _, port = address[len("tcp://") :].rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            return True
    except OSError:
        return False


def tcp_address(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


class SideChannelServer:
    """Answers requests on ``host:port`` (``port=0``: any free port; see :attr:`address`).

    Args:
        codec: frames are decoded with it (compatibility checked first).
        handler: maps each request to its reply; exceptions become error replies.
        secret: shared secret; when set, unauthenticated frames are refused.
        on_refused: called (on the server's thread) for every request refused unread or
            dropped: malformed, unauthenticated, or failing in a way no reply covers.

    No request ends the serving thread: whatever one raises, it is answered with an
    error (or dropped) with one log line, and the next one is served.
    """

    def __init__(
        self,
        codec: Codec,
        host: str,
        port: int,
        handler: Handler,
        secret: str | None = None,
        on_refused: Callable[[], None] = lambda: None,
    ) -> None:
        self._codec = codec
        self._handler = handler
        self._on_refused = on_refused
        self.replays = ReplayGuard()
        """With a secret: the requests served in the freshness window (bounded)."""
        self._secret = secret.encode() if secret else None
        self._ctx = zmq.Context(io_threads=1)
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        limit_socket(self._sock, MAX_FRAME_BYTES + 4096)
        try:
            self._sock.bind(tcp_address(host, port))
        except zmq.ZMQError as exc:
            self._sock.close()
            self._ctx.term()
            raise KVBridgeError(
                f"cannot bind the kvbridge side channel on {host}:{port}: {exc}",
                fix=(
                    "set 'side_channel_port' to a free port (0 picks one) and 'host' to an address "
                    "of this machine"
                ),
            ) from exc
        self.address: str = self._sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._serve, name="kvbridge-sidechannel", daemon=True
        )
        self._thread.start()

    @property
    def port(self) -> int:
        return int(self.address.rsplit(":", 1)[1])

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                if not poller.poll(100):  # wake up regularly to notice close()
                    continue
                frames = self._sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                continue
            except zmq.ZMQError as exc:
                if self._stop.is_set():
                    return
                log.warning("side channel: receive failed: %s", exc)
                continue
            try:
                self._serve_one(frames)
            except Exception:  # no request may end the serving thread
                self._on_refused()
                log.exception("side channel: dropped a request that failed unanswered")

    def _serve_one(self, frames: list[bytes]) -> None:
        if len(frames) < 3:
            self._on_refused()
            log.warning("side channel: dropped a message of %d frames", len(frames))
            return
        identity, rid, payload, *rest = frames
        if len(rid) > _MAX_RID_BYTES:
            self._on_refused()
            log.warning("side channel: dropped a request with a %d-byte request id", len(rid))
            return
        reply = self._answer(rid, payload, rest)
        out = self._codec.encode(reply)
        parts = [identity, rid, out]
        if self._secret is not None:
            tag = rest[0] if rest else b""
            parts.append(mac(self._secret, b"reply", tag, out))
        try:
            self._sock.send_multipart(parts, flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # the client went away meanwhile
            log.debug("side channel: reply not sent: %s", exc)

    def _authentic(self, rid: bytes, payload: bytes, rest: list[bytes]) -> str | None:
        """None when the request is authentic, fresh and new; else why not."""
        if len(rest) != 2 or len(rest[1]) != 8:
            return "authentication failed: set the same 'secret' on prefill and decode"
        tag, when = rest
        if not verify(self._secret, tag, *_request_parts(self.address, when, rid, payload)):
            return "authentication failed: set the same 'secret' on prefill and decode"
        why = self.replays.check(tag, when)
        return None if why is None else f"authentication failed: {why}"

    def _answer(self, rid: bytes, payload: bytes, rest: list[bytes]) -> Message:
        if self._secret is not None and (why := self._authentic(rid, payload, rest)) is not None:
            self._on_refused()
            log.warning("side channel: refused a request: %s", why)
            return Reply(ok=False, code="error", detail=why)
        try:
            msg = self._codec.decode(payload)
        except IncompatiblePeerError as exc:
            self._on_refused()
            log.warning("side channel: refused an incompatible peer: %s", exc)
            return self._incompatible(exc)
        except WireError as exc:
            self._on_refused()
            log.warning("side channel: refused a request: %s", exc)
            return Reply(ok=False, code="error", detail=str(exc))
        try:
            return self._handler(msg)
        except KVBridgeError as exc:
            return Reply(ok=False, code="error", detail=str(exc))
        except Exception as exc:  # a handler bug must not kill the channel
            log.exception("side channel handler failed on %s", type(msg).__name__)
            return Reply(ok=False, code="error", detail=f"{type(exc).__name__}: {exc}")

    def _incompatible(self, exc: IncompatiblePeerError) -> Reply:
        """The answer to a peer of another compatibility class: the properties that
        differ by name and, per property, a digest of our value, from which the peer
        names them too; our values themselves only to an authenticated peer (a secret)."""
        differ = ", ".join(sorted(exc.differences))
        detail = "this prefill's KV cache is incompatible with the peer's" + (
            f" ({differ} differ)" if differ else ""
        )
        salt = os.urandom(16)
        return Reply(
            ok=False,
            code="incompatible",
            detail=f"{detail} (fix: {exc.fix})" if exc.fix else detail,
            compat=self._codec.compat if self._secret is not None else None,
            salt=salt,
            digests=compat_digests(self._codec.compat, salt),
        )

    def close(self, timeout: float = 5.0) -> None:
        """Stop serving; idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout)
        self._sock.close()
        self._ctx.term()


class SideChannelClient:
    """Sends requests to side-channel servers and waits (bounded) for their replies."""

    def __init__(self, codec: Codec, secret: str | None = None) -> None:
        self._codec = codec
        self._secret = secret.encode() if secret else None
        self._ctx = zmq.Context(io_threads=1)
        self._socks: dict[str, tuple[zmq.Socket, threading.Lock]] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._closed = False

    def _socket(self, address: str) -> tuple[zmq.Socket, threading.Lock]:
        with self._lock:
            if self._closed:
                raise KVBridgeError("side channel client is closed")
            entry = self._socks.get(address)
            if entry is None:
                sock = self._ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                limit_socket(sock, MAX_FRAME_BYTES + 4096)
                sock.connect(address)
                entry = self._socks[address] = (sock, threading.Lock())
            return entry

    def request(self, address: str, msg: Message, timeout: float) -> Message:
        """Send ``msg`` to the server at ``address``; return its reply.

        Raises:
            PeerUnreachableError: no reply within ``timeout`` seconds (nobody listens
                there, or the peer is stuck); the socket is reset for the next call.
            WireError: the reply did not decode, or failed authentication.
        """
        sock, lock = self._socket(address)
        rid = str(next(self._ids)).encode()
        payload = self._codec.encode(msg)
        parts, tag = [rid, payload], b""
        if self._secret is not None:
            when = stamp()
            tag = mac(self._secret, *_request_parts(address, when, rid, payload))
            parts += [tag, when]
        deadline = time.monotonic() + timeout
        with lock:
            sock.send_multipart(parts)
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not sock.poll(int(left * 1000) + 1, zmq.POLLIN):
                    self._reset(address)
                    raise PeerUnreachableError(
                        f"no reply from the kvbridge side channel at {address} within {timeout:g}s",
                        fix=(
                            "check that the prefill instance is running with kvbridge and that the "
                            "address is reachable"
                        ),
                    )
                frames = sock.recv_multipart()
                if len(frames) < 2 or frames[0] != rid:
                    continue  # a late reply to an earlier, timed-out request
                if self._secret is not None and (
                    len(frames) != 3
                    or not verify(self._secret, frames[2], b"reply", tag, frames[1])
                ):
                    raise WireError(
                        f"reply from {address} failed authentication",
                        fix="set the same 'secret' on prefill and decode",
                    )
                return self._codec.decode(frames[1])

    def _reset(self, address: str) -> None:
        """Drop a socket whose peer did not answer: queued requests must not reach a
        restarted peer later."""
        with self._lock:
            entry = self._socks.pop(address, None)
        if entry is not None:
            entry[0].close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            entries = list(self._socks.values())
            self._socks.clear()
        for sock, lock in entries:
            with lock:
                sock.close()
        self._ctx.term()


__all__ = ["SideChannelClient", "SideChannelServer", "listening", "tcp_address"]
