"""Notifications over ZeroMQ PUSH/PULL, for transports whose own notifications are unsafe.

Mooncake delivers ``TransferNotify`` through an RPC the engine makes under a global
lock: one frozen peer stalls every transfer to every peer until the engine gives up
(measured: 30 s and more). Notifications here never block: each transport binds one
PULL socket; per peer it keeps one PUSH socket whose sends are non-blocking, so a peer
that stops reading fills its own queue and gets an error, nobody else waits.

Delivery: each notification reaches the peer once, in order per sender, while the TCP
connection holds (ZeroMQ reconnects by itself; frames in flight on a broken connection
can be lost, never duplicated). The PULL socket has read deadlines
(:mod:`.zmqlimits`): a peer that stalls mid-message is disconnected. Frames are
``[sender agent name, payload]``; anything else from the network is dropped with a
warning, never interpreted.

Threads: :meth:`send` may be called from any thread (one lock per peer socket);
:meth:`receive` only from the transport's pump thread.
"""

from __future__ import annotations

import logging
import threading

import zmq

from kvbridge.errors import TransportError, UnknownPeerError
from kvbridge.transports.base import Notification
from kvbridge.transports.zmqlimits import limit_socket

log = logging.getLogger(__name__)

SEND_QUEUE = 100_000
"""Notifications queued per peer before :meth:`ZmqNotifier.send` refuses more."""


class ZmqNotifier:
    """One PULL socket bound on ``host``; PUSH sockets to peers, connected on demand."""

    def __init__(self, host: str) -> None:
        self._ctx = zmq.Context(io_threads=1)
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        limit_socket(self._pull, 1 << 20)
        try:
            self._pull.bind(f"tcp://{host}:0" if ":" not in host else f"tcp://[{host}]:0")
        except zmq.ZMQError as exc:
            self.close()
            raise TransportError(
                f"cannot bind a notification socket on {host!r}: {exc}",
                fix="set 'host' to an address of this machine",
            ) from exc
        self.endpoint: str = self._pull.getsockopt(zmq.LAST_ENDPOINT).decode()
        self._poller = zmq.Poller()
        self._poller.register(self._pull, zmq.POLLIN)
        self._push: dict[str, tuple[zmq.Socket, threading.Lock]] = {}
        self._lock = threading.Lock()

    def connect(self, peer: str, endpoint: str) -> None:
        if not endpoint.startswith("tcp://"):
            raise TransportError(
                f"peer {peer!r} sent a malformed notification endpoint {endpoint!r}"
            )
        sock = self._ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, SEND_QUEUE)
        limit_socket(sock)
        sock.connect(endpoint)
        with self._lock:
            old = self._push.pop(peer, None)
            self._push[peer] = (sock, threading.Lock())
        if old is not None:
            old[0].close()

    def disconnect(self, peer: str) -> None:
        with self._lock:
            entry = self._push.pop(peer, None)
        if entry is not None:
            with entry[1]:
                entry[0].close()

    def send(self, peer: str, sender: str, payload: bytes) -> None:
        """Queue one notification for ``peer``; never blocks."""
        with self._lock:
            entry = self._push.get(peer)
        if entry is None:
            raise UnknownPeerError(f"no notification channel to peer {peer!r}")
        sock, lock = entry
        with lock:
            try:
                sock.send_multipart([sender.encode(), payload], flags=zmq.NOBLOCK)
            except zmq.Again:
                raise TransportError(
                    f"{SEND_QUEUE} notifications to peer {peer!r} are queued unread; the peer is "
                    "not consuming them",
                    fix="check that the peer process is alive and not stopped",
                ) from None
            except zmq.ZMQError as exc:
                raise TransportError(f"notification to peer {peer!r} failed: {exc}") from exc

    def receive(self, timeout_ms: int) -> list[Notification]:
        """Wait up to ``timeout_ms`` for notifications; return every one queued."""
        out: list[Notification] = []
        if not self._poller.poll(timeout_ms):
            return out
        while True:
            try:
                frames = self._pull.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return out
            if len(frames) != 2:
                log.warning(
                    "dropped a notification frame set of %d parts (expected 2)", len(frames)
                )
                continue
            try:
                sender = frames[0].decode()
            except UnicodeDecodeError:
                log.warning("dropped a notification with a non-UTF-8 sender name")
                continue
            out.append(Notification(sender, frames[1]))

    def close(self) -> None:
        with self._lock:
            entries = list(self._push.values())
            self._push.clear()
        for sock, lock in entries:
            with lock:  # a worker may be sending on it
                sock.close()
        if getattr(self, "_pull", None) is not None:
            self._pull.close()
        self._ctx.term()


__all__ = ["SEND_QUEUE", "ZmqNotifier"]
