"""Read deadlines for kvbridge's ZeroMQ sockets that peers connect to.

Who calls: the side channel (:mod:`kvbridge.runtime.sidechannel`, both ends), the
notification sockets of :mod:`kvbridge.transports.notifier`, and the SGLang backend for
SGLang's control sockets. Imports nothing of ours.

What ZeroMQ can bound, and what :func:`limit_socket` sets:

- a peer must finish ZeroMQ's greeting within :data:`HANDSHAKE_S` of connecting;
- every connection is pinged every :data:`HEARTBEAT_S`; one from which nothing
  arrives for :data:`HEARTBEAT_TIMEOUT_S` after a ping is closed, and the message it
  had half sent is dropped with it (a peer that sends half a frame and stalls);
- one message part holds at most ``max_part`` bytes (``ZMQ_MAXMSGSIZE``): a larger one
  closes the connection.

What ZeroMQ cannot bound (libzmq has no option for it): the number of parts of a
message. Parts are queued inside libzmq until the last one arrives, before any
application code (or MAC check) sees the first, so a connected peer that keeps sending
parts, each within ``max_part``, grows the receiver's memory at the rate it sends; and
a peer that trickles bytes faster than :data:`HEARTBEAT_TIMEOUT_S` is never idle. Only
the network bounds who can do that: keep these ports on an isolated network
(docs/user-guide/security.md).
"""

from __future__ import annotations

HEARTBEAT_S = 5.0
"""Ping every connection this often (seconds)."""
HEARTBEAT_TIMEOUT_S = 20.0
"""Close a connection that sent nothing for this long after a ping."""
HANDSHAKE_S = 10.0
"""Close a connection whose ZeroMQ greeting is not done this long after it connected."""


def limit_socket(sock, max_part: int | None = None) -> None:
    """Set the read deadlines above (and ``ZMQ_MAXMSGSIZE`` when ``max_part`` is
    given) on ``sock``, a :class:`zmq.Socket`, before it binds or connects (options
    apply to connections made after they are set)."""
    import zmq

    sock.setsockopt(zmq.HANDSHAKE_IVL, int(HANDSHAKE_S * 1000))
    sock.setsockopt(zmq.HEARTBEAT_IVL, int(HEARTBEAT_S * 1000))
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(HEARTBEAT_TIMEOUT_S * 1000))
    # a peer we connect to also drops us after this long without our traffic
    sock.setsockopt(zmq.HEARTBEAT_TTL, int(HEARTBEAT_TIMEOUT_S * 1000))
    if max_part is not None:
        sock.setsockopt(zmq.MAXMSGSIZE, max_part)


__all__ = ["HANDSHAKE_S", "HEARTBEAT_S", "HEARTBEAT_TIMEOUT_S", "limit_socket"]
