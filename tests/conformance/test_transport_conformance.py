"""One contract, two real transports: every test runs against NIXL and Mooncake, with
the peer in another process on loopback."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections import Counter

import msgspec
import numpy as np
import pytest

from kvbridge.config import load_config
from kvbridge.errors import (
    DeadlineExceeded,
    IncompatiblePeerError,
    InvalidDescriptorError,
    KVBridgeError,
    PeerDisconnectedError,
    PeerUnreachableError,
    TransportError,
    UnknownPeerError,
    WireError,
)
from kvbridge.transports.base import PeerMetadata, decode_metadata, encode_metadata
from kvbridge.transports.testing import Local, Peer, digest, pattern, unique

pytestmark = pytest.mark.conformance

KiB, MiB = 1 << 10, 1 << 20


def scatter_expected(
    src: np.ndarray, src_off: np.ndarray, dst_off: np.ndarray, size: int, nbytes: int
) -> np.ndarray:
    out = np.zeros(nbytes, dtype=np.uint8)
    for s, d in zip(src_off.tolist(), dst_off.tolist(), strict=True):
        out[d : d + size] = src[s : s + size]
    return out


def test_many_small_descriptors_write_byte_for_byte(local: Local, peer: Peer) -> None:
    n, size = 4096, 4 * KiB
    rng = np.random.default_rng(1)
    local.buf[:] = pattern(11, local.buf.nbytes)
    peer.call("zero")
    src_off = rng.permutation(n) * size  # permuted: nothing coalesces
    dst_off = np.arange(n) * size
    lt = local.table(src_off, size)
    rt = local.table(dst_off, size, peer=local.peer_id, base=peer.base)
    x = local.t.post("write", lt, np.arange(n), rt, np.arange(n))
    local.t.wait(x, 30)
    local.t.release(x)
    expected = scatter_expected(local.buf, src_off, dst_off, size, n * size)
    assert peer.call("digest", 0, n * size) == digest(expected)
    assert x.num_descs >= 1 and x.nbytes == n * size


def test_many_descriptors_read_byte_for_byte(local: Local, peer: Peer) -> None:
    n, size = 2048, 8 * KiB
    rng = np.random.default_rng(2)
    peer.call("fill", 22)
    remote_bytes = pattern(22, peer.nbytes)
    local.buf[:] = 0
    src_off = rng.choice(peer.nbytes // size, n, replace=False) * size
    dst_off = np.arange(n) * size
    lt = local.table(dst_off, size)
    rt = local.table(src_off, size, peer=local.peer_id, base=peer.base)
    x = local.t.post("read", lt, np.arange(n), rt, np.arange(n))
    local.t.wait(x, 30)
    local.t.release(x)
    expected = scatter_expected(remote_bytes, src_off, dst_off, size, n * size)
    np.testing.assert_array_equal(local.buf[: n * size], expected)


@pytest.mark.parametrize("which", ["both", "local", "remote"])
def test_one_post_descriptor_lists_of_uneven_lengths_move_byte_for_byte(
    local: Local, peer: Peer, which: str
) -> None:
    """``adhoc`` lists (not prepared; what a peer of another TP split moves for state
    segments): scattered pieces of uneven lengths, written then read back, alone or
    paired with a prepared table on the other side."""
    rng = np.random.default_rng(5)
    sizes = rng.integers(1, 40, 500) * 64  # 64 B .. 2.5 KiB pieces
    step = 4 * KiB
    src_off = rng.permutation(500) * step  # nothing coalesces on the source side
    dst_off = np.arange(500) * step
    local.buf[:] = pattern(55, local.buf.nbytes)
    peer.call("zero")
    lt = local.table(src_off, sizes, adhoc=which != "remote")
    rt = local.table(dst_off, sizes, peer=local.peer_id, base=peer.base, adhoc=which != "local")
    assert lt.prepared is (which == "remote") and rt.prepared is (which == "local")
    x = local.t.post("write", lt, np.arange(500), rt, np.arange(500), notify=b"adhoc")
    local.t.wait(x, 30)
    local.t.release(x)
    expected = np.zeros(500 * step, dtype=np.uint8)
    for s, d, n in zip(src_off.tolist(), dst_off.tolist(), sizes.tolist(), strict=True):
        expected[d : d + n] = local.buf[s : s + n]
    assert peer.call("digest", 0, 500 * step) == digest(expected)
    assert x.nbytes == int(sizes.sum())
    assert (local.t.agent_name, b"adhoc") in peer.call("take", 1, 30)
    # read the same pieces back into zeroed memory
    local.buf[:] = 0
    x = local.t.post("read", lt, np.arange(500), rt, np.arange(500))
    local.t.wait(x, 30)
    local.t.release(x)
    got = np.zeros_like(expected)
    for s, d, n in zip(src_off.tolist(), dst_off.tolist(), sizes.tolist(), strict=True):
        got[d : d + n] = local.buf[s : s + n]
    np.testing.assert_array_equal(got, expected)
    local.t.release_table(lt)  # no-op for a one-post list; a prepared one is freed
    local.t.release_table(rt)


def test_large_transfers_byte_for_byte(local: Local, peer: Peer) -> None:
    local.buf[:] = pattern(33, local.buf.nbytes)
    peer.call("zero")
    whole = local.table(np.array([0]), local.buf.nbytes)
    rwhole = local.table(np.array([0]), peer.nbytes, peer=local.peer_id, base=peer.base)
    x = local.t.post("write", whole, [0], rwhole, [0])
    local.t.wait(x, 60)
    local.t.release(x)
    assert peer.call("digest", 0, peer.nbytes) == digest(local.buf)
    # 8 x 8 MiB, written in reverse order of the regions
    eight = local.table(np.arange(8) * 8 * MiB, 8 * MiB)
    reight = local.table(
        np.arange(8)[::-1].copy() * 8 * MiB, 8 * MiB, peer=local.peer_id, base=peer.base
    )
    local.buf[:] = pattern(34, local.buf.nbytes)
    x = local.t.post("write", eight, np.arange(8), reight, np.arange(8))
    local.t.wait(x, 60)
    local.t.release(x)
    expected = scatter_expected(
        local.buf, np.arange(8) * 8 * MiB, np.arange(8)[::-1] * 8 * MiB, 8 * MiB, peer.nbytes
    )
    assert peer.call("digest", 0, peer.nbytes) == digest(expected)


def test_notifications_delivered_exactly_once(local: Local, peer: Peer) -> None:
    peer.call("take", 10_000, 0.2)  # drain anything earlier tests left
    size = 4 * KiB
    lt = local.table(np.arange(64) * size, size)
    rt = local.table(np.arange(64) * size, size, peer=local.peer_id, base=peer.base)
    sent = []
    for i in range(150):
        payload = f"xfer-{i}".encode() + bytes([i % 256, 0, 255])  # binary-safe payloads
        x = local.t.post("write", lt, [i % 64], rt, [i % 64], notify=payload)
        local.t.wait(x, 30)
        local.t.release(x)
        sent.append(payload)
    for i in range(50):
        payload = f"bare-{i}".encode()
        local.t.notify(local.peer_id, payload)
        sent.append(payload)
    got = peer.call("take", len(sent), 30)
    assert {p for p, _ in got} == {local.t.agent_name}
    counts = Counter(payload for _, payload in got)
    assert counts == Counter(sent), "every notification arrives exactly once"
    # nothing arrives twice later either: a fence sent after everything comes alone
    local.t.notify(local.peer_id, b"fence")
    assert peer.call("take", 1, 30) == [(local.t.agent_name, b"fence")]


def test_concurrent_transfers_from_threads(local: Local, peer: Peer) -> None:
    threads, per_thread, size = 4, 25, 64 * KiB
    local.buf[:] = pattern(44, local.buf.nbytes)
    peer.call("zero")
    peer.call("take", 10_000, 0.2)
    n = threads * per_thread
    lt = local.table(np.arange(n) * size, size)
    rt = local.table(np.arange(n) * size, size, peer=local.peer_id, base=peer.base)
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        try:
            for j in range(per_thread):
                i = k * per_thread + j
                x = local.t.post("write", lt, [i], rt, [i], notify=f"t{k}-{j}".encode())
                local.t.wait(x, 30)
                local.t.release(x)
        except BaseException as exc:  # noqa: BLE001 (surfaced below)
            errors.append(exc)

    pool = [threading.Thread(target=worker, args=(k,)) for k in range(threads)]
    for th in pool:
        th.start()
    for th in pool:
        th.join(120)
    assert not any(th.is_alive() for th in pool), "a posting thread hung"
    assert not errors, errors
    assert peer.call("digest", 0, n * size) == digest(local.buf[: n * size])
    got = peer.call("take", n, 30)
    assert Counter(p for _, p in got) == Counter(
        f"t{k}-{j}".encode() for k in range(threads) for j in range(per_thread)
    )


def test_bad_descriptors_and_peers_get_clear_errors(local: Local, peer: Peer) -> None:
    size = 4 * KiB
    outside = local.base + local.buf.nbytes + 10 * MiB
    with pytest.raises(InvalidDescriptorError, match="outside our registered host memory"):
        local.t.prepare(np.array([[outside, size]], dtype=np.uint64))
    with pytest.raises(InvalidDescriptorError, match="registered host memory"):
        local.table(np.array([peer.nbytes]), size, peer=local.peer_id, base=peer.base)
    with pytest.raises(InvalidDescriptorError, match="registered host memory"):
        local.table(np.array([peer.nbytes]), size, peer=local.peer_id, base=peer.base, adhoc=True)
    with pytest.raises(InvalidDescriptorError, match="outside our registered host memory"):
        local.t.adhoc(np.array([[outside, size]], dtype=np.uint64))
    with pytest.raises(UnknownPeerError, match="add_peer"):
        local.table(np.array([0]), size, peer="nobody", adhoc=True)
    with pytest.raises(UnknownPeerError, match="add_peer"):
        local.table(np.array([0]), size, peer="nobody")
    lt = local.table(np.arange(4) * size, size)
    rt = local.table(np.arange(4) * size, size, peer=local.peer_id, base=peer.base)
    with pytest.raises(InvalidDescriptorError, match="out of range"):
        local.t.post("write", lt, [0, 4], rt, [0, 1])
    with pytest.raises(InvalidDescriptorError, match="differ in length"):
        local.t.post("write", lt, [0, 1], rt, [0])
    short = local.table(np.array([0]), size // 2, peer=local.peer_id, base=peer.base)
    with pytest.raises(InvalidDescriptorError, match="length"):
        local.t.post("write", lt, [0], short, [0])
    with pytest.raises(InvalidDescriptorError, match="op must be"):
        local.t.post("copy", lt, [0], rt, [0])  # type: ignore[arg-type]
    with pytest.raises(WireError, match="malformed"):
        local.t.add_peer(b"\x93not metadata")
    other = "mooncake" if local.t.name == "nixl" else "nixl"
    with pytest.raises(IncompatiblePeerError, match="transport"):
        local.t.add_peer(encode_metadata(PeerMetadata(transport=other, agent="x", payload=b"")))
    # the transport still works after all of that
    x = local.t.post("write", lt, [0], rt, [0])
    local.t.wait(x, 30)
    local.t.release(x)


def test_peer_name_reads_the_agent_and_adds_nothing(local: Local, peer: Peer) -> None:
    """Callers check the agent a peer's metadata names against its sender before
    ``add_peer``, which would replace a known peer."""
    assert local.t.peer_name(peer.metadata) == local.peer_id
    md = decode_metadata(peer.metadata, local.t.name)
    other = encode_metadata(msgspec.structs.replace(md, agent=unique("other")))
    before = local.t.peers
    assert local.t.peer_name(other) == decode_metadata(other, local.t.name).agent
    assert local.t.peers == before
    with pytest.raises(WireError, match="malformed"):
        local.t.peer_name(b"\x93not metadata")
    foreign = "mooncake" if local.t.name == "nixl" else "nixl"
    with pytest.raises(IncompatiblePeerError, match="transport"):
        local.t.peer_name(encode_metadata(PeerMetadata(transport=foreign, agent="x", payload=b"")))


def test_second_handshake_with_a_live_peer_keeps_its_connection(transport_name: str) -> None:
    """Two ``kv_both`` instances that swap the prefill and decode roles shake hands
    again, and each side adds the other's unchanged metadata once more: tables prepared
    before stay valid, the next write lands, notifications arrive once. Other metadata
    under the same peer id (the peer re-registered memory) replaces the peer instead:
    its old tables are released, new ones work."""
    n, size = 8, 4 * KiB
    with Peer(transport_name, unique("both"), nbytes=1 * MiB) as peer:
        loc = Local(transport_name, nbytes=1 * MiB)
        try:
            pid = loc.connect(peer)
            lt = loc.table(np.arange(n) * size, size)
            rt = loc.table(np.arange(n) * size, size, peer=pid, base=peer.base)

            def write(seed: int, note: bytes, remote=rt) -> None:
                loc.buf[:] = pattern(seed, loc.buf.nbytes)
                x = loc.t.post("write", lt, np.arange(n), remote, np.arange(n), notify=note)
                loc.t.wait(x, 30)
                loc.t.release(x)
                assert peer.call("digest", 0, n * size) == digest(loc.buf[: n * size])

            write(1, b"before")
            assert loc.connect(peer) == pid  # both sides add each other again
            write(2, b"after")
            assert Counter(p for _, p in peer.call("take", 3, 2)) == Counter([b"before", b"after"])

            md = decode_metadata(peer.metadata, transport_name)
            half = [(addr, length // 2, dev, mem) for addr, length, dev, mem in md.regions]
            assert loc.t.add_peer(encode_metadata(msgspec.structs.replace(md, regions=half))) == pid
            with pytest.raises(InvalidDescriptorError, match="released"):
                loc.t.post("write", lt, [0], rt, [0])
            write(3, b"replaced", loc.table(np.arange(n) * size, size, peer=pid, base=peer.base))
        finally:
            loc.close()


def test_adding_a_peer_that_waits_for_our_answer_does_not_wait_on_it(transport_name: str) -> None:
    """The prefill side adds a decode peer inside its answer to that peer's handshake
    (``probe=False``), while the peer waits for the answer: the call must not wait on
    the peer, here one that cannot answer at all (SIGSTOPped). A write after the peer
    resumes lands."""
    size = 64 * KiB
    with Peer(transport_name, unique("paused"), nbytes=1 * MiB) as peer:
        loc = Local(transport_name, nbytes=1 * MiB)
        try:
            with peer.paused():
                start = time.monotonic()
                pid = loc.t.add_peer(peer.metadata, probe=False)
                took = time.monotonic() - start
            assert took < 2, f"add_peer(probe=False) waited {took:.1f}s on a stopped peer"
            loc.buf[:] = pattern(5, loc.buf.nbytes)
            lt = loc.table(np.array([0]), size)
            rt = loc.table(np.array([0]), size, peer=pid, base=peer.base)
            x = loc.t.post("write", lt, [0], rt, [0])
            loc.t.wait(x, 60)
            loc.t.release(x)
            assert peer.call("digest", 0, size) == digest(loc.buf[:size])
        finally:
            loc.close()


def _write_until_failure(loc: Local, lt, rt, deadline: float) -> KVBridgeError | None:
    """Keep writing to a peer until the transport reports an error or time runs out."""
    while time.monotonic() < deadline:
        try:
            x = loc.t.post("write", lt, [0], rt, [0])
            loc.t.wait(x, max(0.1, deadline - time.monotonic()))
            loc.t.release(x)
        except KVBridgeError as exc:
            return exc
    return None


def test_peer_killed_mid_transfer(transport_name: str) -> None:
    """A SIGKILLed peer yields a kvbridge error within a bound; other peers keep working."""
    with (
        Peer(transport_name, unique("victim")) as victim,
        Peer(transport_name, unique("bystander")) as bystander,
    ):
        loc = Local(transport_name)
        try:
            vid, bid = loc.connect(victim), loc.connect(bystander)
            lt = loc.table(np.array([0]), 64 * MiB)
            vt = loc.table(np.array([0]), 64 * MiB, peer=vid, base=victim.base)
            x = loc.t.post("write", lt, [0], vt, [0])
            loc.t.wait(x, 30)  # the victim was reachable
            loc.t.release(x)
            x = loc.t.post("write", lt, [0], vt, [0])  # in flight when the peer dies
            victim.kill()
            killed = time.monotonic()
            try:
                loc.t.wait(x, 20)
                loc.t.release(x)
                err = _write_until_failure(loc, lt, vt, killed + 20)
            except KVBridgeError as exc:
                err = exc
            elapsed = time.monotonic() - killed
            print(f"\n{transport_name}: peer death reported after {elapsed:.2f}s as {err!r}")
            assert err is not None, "writes to a killed peer kept succeeding for 20 s"
            assert isinstance(err, (PeerDisconnectedError, DeadlineExceeded)), repr(err)
            assert elapsed < 25
            # the caller survives and still talks to other peers
            loc.buf[:] = pattern(55, loc.buf.nbytes)
            bt = loc.table(np.array([0]), 64 * MiB, peer=bid, base=bystander.base)
            y = loc.t.post("write", lt, [0], bt, [0])
            loc.t.wait(y, 30)
            loc.t.release(y)
            assert bystander.call("digest", 0, 64 * MiB) == digest(loc.buf)
            loc.t.remove_peer(vid)
        finally:
            loc.close()


def test_peer_that_never_answers_is_unreachable(transport_name: str) -> None:
    """Metadata of a peer that is gone: the first transfer fails clearly and in time."""
    gone = Peer(transport_name, unique("gone"), nbytes=1 * MiB)
    md, base = gone.metadata, gone.base
    gone.stop()
    loc = Local(transport_name, nbytes=1 * MiB)
    start = time.monotonic()
    try:
        try:  # NIXL connects while loading metadata, Mooncake on the first transfer
            pid = loc.t.add_peer(md)
            lt = loc.table(np.array([0]), 4 * KiB)
            rt = loc.table(np.array([0]), 4 * KiB, peer=pid, base=base)
            err = _write_until_failure(loc, lt, rt, start + 15)
        except KVBridgeError as exc:
            err = exc
        assert err is not None, "writes to a stopped peer never failed"
        print(
            f"\n{transport_name}: stale peer reported after {time.monotonic() - start:.2f}s as "
            f"{err!r}"
        )
        assert isinstance(err, (PeerUnreachableError, DeadlineExceeded)), repr(err)
        assert "peer" in str(err) and err.fix, f"error should name the peer and a fix: {err}"
        assert time.monotonic() - start < 20
    finally:
        loc.close()


def test_close_releases_everything_and_stops_threads(transport_name: str) -> None:
    with Peer(transport_name, unique("closer"), nbytes=1 * MiB) as other:
        loc = Local(transport_name, nbytes=1 * MiB)
        pid = loc.connect(other)
        lt = loc.table(np.arange(4) * 4 * KiB, 4 * KiB)
        rt = loc.table(np.arange(4) * 4 * KiB, 4 * KiB, peer=pid, base=other.base)
        done = loc.t.post("write", lt, [0], rt, [0])
        loc.t.wait(done, 30)
        pending = loc.t.post("write", lt, [1, 2, 3], rt, [1, 2, 3])  # left for close() to release
        loc.close()
        loc.close()  # idempotent
        assert done.released and pending.released
        assert lt.released and rt.released
        with pytest.raises(TransportError, match="closed"):
            loc.t.post("write", lt, [0], rt, [0])
        # the peer process measures its own threads around create ... close
        report = other.call("close")
        (base_py, base_os), (after_py, after_os) = report["baseline"], report["after"]
        assert after_py == base_py, "python threads left running after close"
        assert after_os <= base_os, (
            f"OS threads: {base_os} before the transport, {after_os} after close: "
            f"{report['os_thread_names']}"
        )


@pytest.mark.parametrize("close", [True, False], ids=["closed", "not-closed"])
def test_process_using_the_transport_exits_cleanly(transport_name: str, close: bool) -> None:
    """A worker that used the transport exits with status 0, whether or not it closed
    it. NIXL's bundled libraries once crashed every such process at exit; an unclosed
    agent aborted about one exit in five, hence several runs."""
    script = (
        "import numpy as np\nfrom kvbridge.transports.testing import Local\nloc = "
        f"Local({transport_name!r}, nbytes=1 << 20)\nloc.t.prepare(np.array([[loc.base, 4096]], "
        "dtype=np.uint64))\n" + ("loc.close()\n" if close else "")
    )
    for _ in range(1 if close else 5):
        proc = subprocess.run(
            [sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=120
        )
        assert proc.returncode == 0, f"exit status {proc.returncode}\n{proc.stderr[-2000:]}"


def test_hung_peer_does_not_block_other_peers(transport_name: str) -> None:
    """A SIGSTOPped peer neither answers nor dies. Transfers and notifications to it
    may stall (bounded by their deadlines), but never those to other peers."""
    with (
        Peer(transport_name, unique("hung")) as hung,
        Peer(transport_name, unique("healthy")) as healthy,
    ):
        loc = Local(transport_name, config=load_config({"timeouts": {"transfer_s": 5}}))
        try:
            hid, bid = loc.connect(hung), loc.connect(healthy)
            lt = loc.table(np.array([0]), 64 * MiB)
            ht = loc.table(np.array([0]), 64 * MiB, peer=hid, base=hung.base)
            bt = loc.table(np.array([0]), 64 * MiB, peer=bid, base=healthy.base)
            with hung.paused(timeout=10):
                outcome: dict[str, object] = {}

                def talk_to_hung() -> None:
                    try:
                        x = loc.t.post("write", lt, [0], ht, [0], notify=b"to-hung")
                        loc.t.notify(hid, b"bare-to-hung")
                        loc.t.wait(x, 5)
                        outcome["hung"] = "completed"
                    except KVBridgeError as exc:
                        outcome["hung"] = exc

                side = threading.Thread(target=talk_to_hung)
                side.start()
                loc.buf[:] = pattern(66, loc.buf.nbytes)
                start = time.monotonic()
                for _ in range(3):
                    y = loc.t.post("write", lt, [0], bt, [0], notify=b"to-healthy")
                    loc.t.wait(y, 20)
                    loc.t.release(y)
                healthy_s = time.monotonic() - start
                assert healthy.call("digest", 0, 64 * MiB) == digest(loc.buf)
                assert healthy_s < 10, (
                    f"writes to the healthy peer took {healthy_s:.1f}s while another peer hung"
                )
                side.join(60)
                assert not side.is_alive(), "talking to the hung peer never returned"
                # cma (NIXL) may complete a write into a stopped process; otherwise the wait ends in
                # an error
                assert outcome["hung"] == "completed" or isinstance(
                    outcome["hung"], (DeadlineExceeded, TransportError)
                ), outcome
        finally:
            loc.close()
