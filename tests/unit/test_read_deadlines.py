"""Read deadlines on the sockets peers connect to (:mod:`kvbridge.transports.zmqlimits`):
a peer that sends half a message and stalls, or never finishes ZeroMQ's greeting, is
disconnected (its half message dropped) while the socket serves everyone else. The
peer here speaks ZMTP 3.0 by hand over a plain TCP socket, as a hostile one would.
Before these deadlines the connection stayed open for good (the test waits for the
close and fails)."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest
import zmq

from kvbridge.runtime.sidechannel import SideChannelServer
from kvbridge.transports import zmqlimits
from kvbridge.transports.notifier import ZmqNotifier
from kvbridge.wire.codec import Codec
from kvbridge.wire.messages import Heartbeat, PeerId, Reply
from kvbridge.wire.peer_compat import CompatInfo

INFO = CompatInfo(
    model="m",
    dtype="float32",
    layout="fused",
    block_size=16,
    num_layers=2,
    num_kv_heads=2,
    head_dim=8,
)
CLOSED_WITHIN_S = 5.0


@pytest.fixture(autouse=True)
def short_deadlines(monkeypatch) -> None:
    monkeypatch.setattr(zmqlimits, "HEARTBEAT_S", 0.1)
    monkeypatch.setattr(zmqlimits, "HEARTBEAT_TIMEOUT_S", 0.4)
    monkeypatch.setattr(zmqlimits, "HANDSHAKE_S", 0.4)


def _host_port(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint[len("tcp://") :].rpartition(":")
    return host, int(port)


def _greet(sock: socket.socket, socket_type: bytes) -> None:
    """ZMTP 3.0 with the NULL mechanism: greeting, then READY naming our socket type."""
    greeting = b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00")
    sock.sendall(greeting + b"\x00" + b"\x00" * 31)
    got = b""
    while len(got) < 64:
        got += sock.recv(64 - len(got))
    prop = b"\x0bSocket-Type" + len(socket_type).to_bytes(4, "big") + socket_type
    body = b"\x05READY" + prop
    sock.sendall(b"\x04" + bytes([len(body)]) + body)


def _closed_by_peer(sock: socket.socket, within: float) -> bool:
    """Whether the other end closes ``sock`` within ``within`` seconds (what it sends
    meanwhile, its READY and pings, is read and ignored: we never answer a ping)."""
    deadline = time.monotonic() + within
    while (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            if not sock.recv(4096):
                return True
        except TimeoutError:
            return False
        except ConnectionResetError:
            return True
    return False


def _staller(endpoint: str, socket_type: bytes, greet: bool = True) -> socket.socket:
    sock = socket.create_connection(_host_port(endpoint), timeout=5)
    if greet:
        _greet(sock, socket_type)
        # the first part of a message (more follow), then 1 byte of a 232-byte part
        sock.sendall(b"\x01\x01" + b"7" + b"\x00\xe8" + b"x")
    return sock


@pytest.fixture
def server() -> Iterator[SideChannelServer]:
    codec = Codec(INFO)
    srv = SideChannelServer(codec, "127.0.0.1", 0, lambda msg: Reply(ok=True, epoch="e"))
    yield srv
    srv.close()


def _served(srv: SideChannelServer) -> bool:
    codec = Codec(INFO)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(srv.address)
    try:
        sock.send_multipart([b"1", codec.encode(Heartbeat(peer=PeerId(engine_id="d", epoch="e")))])
        return bool(sock.poll(5000)) and isinstance(codec.decode(sock.recv_multipart()[1]), Reply)
    finally:
        sock.close()
        ctx.term()


@pytest.mark.parametrize("greet", [True, False], ids=["half-a-message", "no-greeting"])
def test_a_side_channel_peer_that_stalls_is_disconnected_and_others_are_served(
    server, greet: bool
) -> None:
    staller = _staller(server.address, b"DEALER", greet=greet)
    try:
        assert _served(server), "the side channel serves others while a peer stalls"
        assert _closed_by_peer(staller, CLOSED_WITHIN_S), (
            "a peer that stalled mid-message was never disconnected"
        )
        assert _served(server)
    finally:
        staller.close()


def test_a_notification_peer_that_stalls_is_disconnected() -> None:
    notifier = ZmqNotifier("127.0.0.1")
    staller = _staller(notifier.endpoint, b"PUSH")
    try:
        assert _closed_by_peer(staller, CLOSED_WITHIN_S)
    finally:
        staller.close()
        notifier.close()
