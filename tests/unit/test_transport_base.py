"""The backend-independent half of the transport contract, on the in-process double,
and the registry's error messages."""

from __future__ import annotations

import itertools
import logging
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from kvbridge.errors import (
    InvalidDescriptorError,
    PeerDisconnectedError,
    PeerUnreachableError,
    TransportError,
    TransportUnavailableError,
    UnknownPeerError,
    UnknownTransportError,
)
from kvbridge.transports import create_transport
from kvbridge.transports.common import Inbox, Pump, RegionIndex
from kvbridge.transports.loopback import LoopbackTransport
from kvbridge.transports.registry import TransportEntry, load, register_transport

_ids = itertools.count()


class Side:
    def __init__(self, nbytes: int = 1 << 16) -> None:
        self.t = LoopbackTransport(f"side-{next(_ids)}")
        self.buf = np.zeros(nbytes, dtype=np.uint8)
        self.t.register([(self.buf.ctypes.data, nbytes)])

    def descs(self, offsets, length):
        return np.array([[self.buf.ctypes.data + o, length] for o in offsets], dtype=np.uint64)


@pytest.fixture
def pair():
    a, b = Side(), Side()
    bid = a.t.add_peer(b.t.metadata())
    a.t_peer = bid
    b.t.add_peer(a.t.metadata())
    yield a, b
    a.t.close()
    b.t.close()


def test_write_read_and_notify(pair) -> None:
    a, b = pair
    a.buf[:] = np.arange(a.buf.size) % 251
    lt = a.t.prepare(a.descs([0, 4096, 8192], 4096))
    rt = a.t.prepare(b.descs([8192, 0, 4096], 4096), peer=a.t_peer)
    x = a.t.post("write", lt, [0, 1, 2], rt, [0, 1, 2], notify=b"n1")
    a.t.wait(x, 1)
    a.t.release(x)
    a.t.release(x)  # idempotent
    np.testing.assert_array_equal(b.buf[8192:12288], a.buf[0:4096])
    np.testing.assert_array_equal(b.buf[0:4096], a.buf[4096:8192])
    b.buf[20000:24096] = 7
    back = a.t.prepare(b.descs([20000], 4096), peer=a.t_peer)
    x = a.t.post("read", lt, [2], back, [0])
    a.t.wait(x, 1)
    assert (a.buf[8192:12288] == 7).all()
    a.t.notify(a.t_peer, b"bare")
    got = b.t.take_notifications(1)
    assert [(n.peer, n.payload) for n in got] == [
        (a.t.agent_name, b"n1"),
        (a.t.agent_name, b"bare"),
    ]
    assert b.t.take_notifications(0) == [], "each notification is handed out once"


def test_descriptor_validation(pair) -> None:
    a, b = pair
    with pytest.raises(InvalidDescriptorError, match="outside our registered host memory"):
        a.t.prepare(np.array([[a.buf.ctypes.data + a.buf.size - 8, 16]], dtype=np.uint64))
    with pytest.raises(InvalidDescriptorError, match=r"\(N, 2\) or \(N, 3\)"):
        a.t.prepare(np.zeros((2, 4), dtype=np.uint64))
    with pytest.raises(InvalidDescriptorError, match="empty"):
        a.t.prepare(np.zeros((0, 2), dtype=np.uint64))
    with pytest.raises(InvalidDescriptorError, match="positive"):
        a.t.prepare(a.descs([0], 0))
    with pytest.raises(UnknownPeerError):
        a.t.prepare(a.descs([0], 8), peer="stranger")
    lt = a.t.prepare(a.descs([0], 8))
    with pytest.raises(InvalidDescriptorError, match="needs a local table and a peer's table"):
        a.t.post("write", lt, [0], lt, [0])
    with pytest.raises(InvalidDescriptorError, match="1-D integer"):
        a.t.post("write", lt, [0.5], a.t.prepare(b.descs([0], 8), peer=a.t_peer), [0])
    with pytest.raises(InvalidDescriptorError, match="regions must be non-empty"):
        a.t.register([])


def test_adjacent_registrations_accept_a_spanning_descriptor() -> None:
    idx = RegionIndex()
    idx.add([(1000, 100)], "host", 0)
    idx.add([(1100, 100)], "host", 0)
    ok = np.array([[1050, 100, 0]], dtype=np.uint64)
    assert idx.first_outside(ok, "host") is None
    assert idx.first_outside(np.array([[1150, 100, 0]], dtype=np.uint64), "host") == (1150, 100)
    assert idx.first_outside(ok, "device") == (1050, 100), "memory kinds are separate"
    assert idx.first_outside(np.array([[1050, 100, 1]], dtype=np.uint64), "host") == (1050, 100), (
        "devices are separate"
    )
    idx.remove([(1100, 100)], "host", 0)
    assert idx.first_outside(ok, "host") == (1050, 100)
    # rows of two devices in one list: each checked against its own
    idx.add([(5000, 100)], "host", 1)
    mixed = np.array([[1010, 50, 0], [5010, 50, 1], [1020, 10, 0]], dtype=np.uint64)
    assert idx.first_outside(mixed, "host") is None
    assert idx.first_outside(
        np.array([[5010, 50, 1], [1010, 50, 0], [1010, 50, 1]], dtype=np.uint64), "host"
    ) == (1010, 50)


def test_dead_peer_and_unreachable_peer(pair) -> None:
    a, b = pair
    lt = a.t.prepare(a.descs([0], 64))
    rt = a.t.prepare(b.descs([0], 64), peer=a.t_peer)
    b.t.kill()
    with pytest.raises(PeerUnreachableError, match="could not reach"):
        a.t.post("write", lt, [0], rt, [0])
    b.t.alive = True
    a.t.wait(a.t.post("write", lt, [0], rt, [0]), 1)
    b.t.kill()
    with pytest.raises(PeerDisconnectedError, match="disconnected"):
        a.t.post("write", lt, [0], rt, [0])


def test_remove_peer_releases_its_tables(pair) -> None:
    a, b = pair
    rt = a.t.prepare(b.descs([0], 64), peer=a.t_peer)
    a.t.remove_peer(a.t_peer)
    assert rt.released and a.t.peers == []
    a.t.remove_peer(a.t_peer)  # unknown: ignored
    with pytest.raises(UnknownPeerError):
        a.t.notify(a.t_peer, b"x")


def test_close_releases_everything_once(pair) -> None:
    a, b = pair
    lt = a.t.prepare(a.descs([0], 64))
    rt = a.t.prepare(b.descs([0], 64), peer=a.t_peer)
    x = a.t.post("write", lt, [0], rt, [0])
    a.t.close()
    assert x.released and lt.released and rt.released and a.t.peers == []
    a.t.close()
    with pytest.raises(TransportError, match="closed"):
        a.t.prepare(a.descs([0], 64))
    with pytest.raises(TransportError, match="closed"):
        a.t.metadata()


def test_own_metadata_is_refused() -> None:
    s = Side()
    with pytest.raises(TransportError, match="our own agent name"):
        s.t.add_peer(s.t.metadata())
    s.t.close()


def test_inbox_take_waits_at_most_the_timeout() -> None:
    inbox = Inbox()
    assert inbox.take(0.01) == []
    got: list = []
    reader = threading.Thread(target=lambda: got.extend(inbox.take(5)))
    reader.start()
    inbox.put([("p", b"x")])  # type: ignore[list-item]
    reader.join(5)
    assert got == [("p", b"x")]


def test_pump_survives_a_failing_step_and_stops() -> None:
    calls = {"n": 0}
    seen = threading.Event()

    def step() -> int:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("backend hiccup")
        seen.set()
        return 0

    pump = Pump("test-pump", step)
    pump.start()
    assert seen.wait(5), "pump stopped after one failing step"
    pump.stop()
    assert not pump._thread.is_alive()


def _counting_pump(busy) -> tuple[Pump, threading.Semaphore]:
    """A pump whose steps find nothing, each released on the semaphore, that waits a
    minute between steps once idle (a test fails long before that)."""
    steps = threading.Semaphore(0)

    def step() -> int:
        steps.release()
        return 0

    return Pump("test-pump", step, max_interval=1e-3, idle_interval=60.0, busy=busy), steps


def _settle(steps: threading.Semaphore) -> None:
    """Wait out the pump's quick first steps (its interval doubles from 0.1 ms)."""
    while steps.acquire(timeout=1.0):
        pass


def test_an_idle_pump_waits_and_a_wake_makes_it_step_at_once() -> None:
    pump, steps = _counting_pump(busy=lambda: False)
    pump.start()
    try:
        _settle(steps)  # now waiting a minute
        pump.wake()
        assert steps.acquire(timeout=5), "a woken pump steps at once"
    finally:
        pump.stop()
    assert not pump._thread.is_alive(), "stop ends an idle pump's wait"


@pytest.mark.parametrize(
    ("busy", "logged"), [(lambda: True, 0), (lambda: 1 / 0, 1)], ids=["busy", "probe fails"]
)
def test_a_busy_pump_keeps_polling(busy, logged: int, caplog: pytest.LogCaptureFixture) -> None:
    """Something is expected (or the probe cannot tell): the pump polls at its busy pace,
    every millisecond here, not every minute; a failing probe is logged once, not at
    every step."""
    pump, steps = _counting_pump(busy=busy)
    with caplog.at_level(logging.ERROR, logger="kvbridge.transports.common"):
        pump.start()
        try:
            assert all(steps.acquire(timeout=5) for _ in range(50))
        finally:
            pump.stop()
    assert len(caplog.records) == logged


def test_a_transport_is_busy_unless_every_probe_says_nothing_is_expected() -> None:
    t = LoopbackTransport("demand")
    try:
        assert t._busy(), "no probe: always busy (the pump's pace before probes)"
        expecting = {"rx": False, "tx": False}
        rx, tx = (lambda: expecting["rx"]), (lambda: expecting["tx"])
        t.add_demand(rx)
        t.add_demand(tx)
        assert not t._busy()
        expecting["tx"] = True
        assert t._busy()
        t.remove_demand(tx)
        assert not t._busy()
        t.wake()  # no pump (loopback delivers at once): nothing to do
    finally:
        t.close()


def test_unknown_transport_suggests_the_name() -> None:
    with pytest.raises(UnknownTransportError, match="did you mean 'mooncake'") as info:
        create_transport("moncake", None, agent_name="x")
    assert info.value.key == "transport"


def test_missing_dependency_gives_install_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "kvb_fake_rdma.py").write_text(
        "raise ImportError('libibverbs.so.1: cannot open shared object file: No such file or "
        "directory')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    register_transport(
        TransportEntry(
            "fake-rdma",
            "kvb_fake_rdma:T",
            "test",
            "pip install fake",
            hints=((r"libibverbs", "apt-get install -y libibverbs1"),),
        )
    )
    register_transport(
        TransportEntry(
            "fake-absent", "kvb_not_installed_anywhere:T", "test", "pip install 'kvbridge[absent]'"
        )
    )
    with pytest.raises(TransportUnavailableError, match=r"fix: apt-get install -y libibverbs1"):
        load("fake-rdma")
    with pytest.raises(TransportUnavailableError, match=r"fix: pip install 'kvbridge\[absent\]'"):
        load("fake-absent")
    sys.modules.pop("kvb_fake_rdma", None)
