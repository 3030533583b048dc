"""Mooncake's retry of a batch that fails while its peer is alive: a real engine and a
real peer process on loopback; only the failures are injected (the transport's attempt
at a transfer answers -1 a given number of times before it runs)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from kvbridge.errors import TransferFailedError
from kvbridge.transports.testing import Local, Peer, digest, pattern, unique

pytestmark = pytest.mark.conformance

KiB = 1 << 10


class _FailingMoves:
    """The transport's own attempt at one transfer (``_move``), whose next ``failures``
    calls fail as a broken TCP lane's do (rc -1, peer still answering probes) without
    moving anything."""

    def __init__(self, move: Callable[..., int], failures: int) -> None:
        self._move = move
        self.failures = failures
        self.batches = 0

    def __call__(self, *args: object) -> int:
        self.batches += 1
        if self.failures > 0:
            self.failures -= 1
            return -1
        return self._move(*args)


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[Local, Peer]]:
    with Peer("mooncake", unique("retry-peer")) as peer:
        local = Local("mooncake")
        local.peer_id = local.connect(peer)  # type: ignore[attr-defined]
        try:
            yield local, peer
        finally:
            local.close()


def _write(local: Local, peer: Peer, failures: int, seed: int) -> tuple[_FailingMoves, float]:
    """Inject ``failures``, write 64 KiB with a notification; (engine, seconds taken).
    Raises what the transport raises."""
    from kvbridge.transports.mooncake import MooncakeTransport

    t = local.t
    assert isinstance(t, MooncakeTransport)
    n, size = 16, 4 * KiB
    local.buf[: n * size] = pattern(seed, n * size)
    peer.call("zero")
    lt = local.table(np.arange(n) * size, size)
    rt = local.table(np.arange(n) * size, size, peer=local.peer_id, base=peer.base)  # type: ignore[attr-defined]
    flaky = _FailingMoves(t._move, failures)
    t._move = flaky  # type: ignore[method-assign]
    start = time.monotonic()
    try:
        x = t.post("write", lt, np.arange(n), rt, np.arange(n), notify=f"seed-{seed}".encode())
        try:
            t.wait(x, 30)
        finally:
            t.release(x)
    finally:
        del t._move  # the class's again
    return flaky, time.monotonic() - start


def test_transient_failures_with_the_peer_alive_are_retried(pair: tuple[Local, Peer]) -> None:
    from kvbridge.transports.mooncake import RETRY_PAUSES_S

    local, peer = pair
    n = 16 * 4 * KiB
    flaky, _ = _write(local, peer, failures=len(RETRY_PAUSES_S), seed=5)
    assert flaky.batches == len(RETRY_PAUSES_S) + 1  # every retry used, the last one landed
    assert peer.call("digest", 0, n) == digest(local.buf[:n])
    # the notification follows the landed batch, once
    assert [p for _, p in peer.call("take", 1, 10)] == [b"seed-5"]


def test_a_batch_failing_every_retry_fails_with_the_count_and_the_transport_keeps_working(
    pair: tuple[Local, Peer],
) -> None:
    from kvbridge.transports.mooncake import RETRY_PAUSES_S

    local, peer = pair
    with pytest.raises(
        TransferFailedError,
        match=(
            rf"failed \(rc=-1\) {len(RETRY_PAUSES_S) + 1} times although the peer answers a "
            "probe"
        ),
    ) as info:
        _write(local, peer, failures=100, seed=6)
    assert "registered on the peer" in (info.value.fix or "")
    assert peer.call("take", 1, 0.5) == []  # a failed batch sends no notification
    flaky, _ = _write(local, peer, failures=0, seed=7)
    assert flaky.batches == 1
    n = 16 * 4 * KiB
    assert peer.call("digest", 0, n) == digest(local.buf[:n])


def test_a_lane_that_moves_nothing_is_dropped_in_a_third_of_the_transfer_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Mooncake drops a TCP lane that moved no byte for ``MC_TCP_PROGRESS_TIMEOUT_SEC``
    (30 s by default: a whole default ``transfer_s``, leaving no time for the retry);
    the transport sets it to a third of ``transfer_s`` unless the option or the user
    says otherwise. Here the peer stops reading (SIGSTOP): the engine's batch fails
    after that time, which is when the transport probes and retries."""
    import os

    from kvbridge.config import load_config
    from kvbridge.transports import mooncake

    monkeypatch.delenv("MC_TCP_PROGRESS_TIMEOUT_SEC", raising=False)  # restored after the test
    monkeypatch.setenv(mooncake._OWN_ENV, os.environ.get(mooncake._OWN_ENV, ""))
    config = load_config({"transport": "mooncake", "timeouts": {"transfer_s": 9}})
    assert (
        mooncake.progress_timeout_s(
            load_config({"mooncake": {"progress_timeout_s": 5}}).mooncake, 9
        )
        == 5
    )
    assert mooncake.progress_timeout_s(config.mooncake, 3) == 2
    with Peer("mooncake", unique("stalled-peer"), nbytes=1 << 20) as peer:
        local = Local("mooncake", nbytes=1 << 20, config=config)
        try:
            assert os.environ["MC_TCP_PROGRESS_TIMEOUT_SEC"] == "3"
            pid = local.t.add_peer(peer.metadata)
            engine, endpoint = local.t._engine, local.t._endpoints[pid]  # type: ignore[attr-defined]
            with peer.paused():
                start = time.monotonic()
                rc = engine.batch_transfer_sync(
                    endpoint,
                    [local.base],
                    [peer.base],
                    [1 << 20],
                    mooncake.TransferOpcode.Write,
                    None,
                )
                took = time.monotonic() - start
            assert rc != 0 and 2.5 < took < 6, (
                f"the stalled lane ended after {took:.1f}s (rc {rc}); the transport set 3s"
            )
        finally:
            local.close()
    monkeypatch.setenv("MC_TCP_PROGRESS_TIMEOUT_SEC", "7")  # not the value kvbridge set: the user's
    Local("mooncake", nbytes=4096, config=config).close()
    assert os.environ["MC_TCP_PROGRESS_TIMEOUT_SEC"] == "7", "the user's setting wins"


class _NiceRecorder:
    """The real engine, recording the nice value of each thread that submits a batch
    (and then waits for it)."""

    def __init__(self, engine: object) -> None:
        self._engine = engine
        self.nice: list[int] = []

    def batch_transfer_async(self, *args: object) -> int:
        import os
        import threading

        self.nice.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        return self._engine.batch_transfer_async(*args)  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> object:
        return getattr(self._engine, name)


@pytest.mark.parametrize("nice", [19, 0])
def test_the_threads_waiting_on_batches_run_at_the_configured_nice(nice: int) -> None:
    """The pool threads that submit and wait for transfers run at
    ``mooncake.waiter_nice`` (0: the process's own priority), and the transfer still
    lands."""
    import os

    from kvbridge.config import load_config

    base = os.getpriority(os.PRIO_PROCESS, 0)
    with Peer("mooncake", unique("nice-peer"), nbytes=1 << 20) as peer:
        local = Local(
            "mooncake", nbytes=1 << 20, config=load_config({"mooncake": {"waiter_nice": nice}})
        )
        try:
            pid = local.connect(peer)
            recorder = _NiceRecorder(local.t._engine)  # type: ignore[attr-defined]
            local.t._engine = recorder  # type: ignore[attr-defined]
            local.buf[:4096] = pattern(9, 4096)
            x = local.t.post(
                "write",
                local.table(np.array([0]), 4096),
                [0],
                local.table(np.array([0]), 4096, peer=pid, base=peer.base),
                [0],
            )
            local.t.wait(x, 30)
            assert peer.call("digest", 0, 4096) == digest(local.buf[:4096])
            assert recorder.nice == [max(nice, base)]
            assert os.getpriority(os.PRIO_PROCESS, 0) == base, (
                "the caller's own priority is untouched"
            )
        finally:
            local.close()


def test_a_child_process_does_not_take_the_engine_settings_kvbridge_made_for_the_user_s(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The engine reads ``MC_*`` variables from the environment, which child processes
    inherit (a test process, or an engine process, starting servers after making a
    transport): a child must apply its own config, not the parent's values, and still
    keep a value the user set. Found in CI: a 2 s lane timeout left by a test with a
    6 s ``transfer_s`` reached later vLLM servers and dropped their lanes."""
    import os
    import subprocess
    import sys

    from kvbridge.config import load_config
    from kvbridge.transports import mooncake

    for name in ("MC_TCP_PROGRESS_TIMEOUT_SEC", "MC_TRANSFER_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(mooncake._OWN_ENV, "")
    Local("mooncake", nbytes=4096, config=load_config({"timeouts": {"transfer_s": 6}})).close()
    assert (os.environ["MC_TCP_PROGRESS_TIMEOUT_SEC"], os.environ["MC_TRANSFER_TIMEOUT"]) == (
        "2",
        "6",
    )
    code = (
        "import os\nfrom kvbridge.config import load_config\nfrom kvbridge.transports.testing "
        "import Local\n"
        "Local('mooncake', nbytes=4096, config=load_config({})).close()\n"
        "print(os.environ['MC_TCP_PROGRESS_TIMEOUT_SEC'], os.environ['MC_TRANSFER_TIMEOUT'])\n"
    )

    def child(**env: str) -> list[str]:
        out = subprocess.run(
            [sys.executable, "-c", code],
            check=False,
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, **env},
        )
        assert out.returncode == 0, out.stderr[-2000:]
        return out.stdout.split()[-2:]

    assert child() == ["10", "30"], "the child follows its own config (transfer_s 30)"
    assert child(MC_TCP_PROGRESS_TIMEOUT_SEC="7") == ["7", "30"], "a value the user set wins"


def test_a_transfer_waiting_on_a_stopped_peer_takes_no_core() -> None:
    """The engine's own waits (``batch_transfer_sync``, ``get_batch_transfer_status``)
    spin, a core per transfer in flight, for as long as the peer takes (on a small
    machine: the serving engine's forward loses it). The transport's waiting thread,
    at the process's own priority (``waiter_nice: 0``, where a spin takes all it
    can), uses a small share of a core while a stopped peer holds a transfer, and the
    transfer lands once the peer resumes."""
    import time

    from kvbridge.config import load_config
    from kvbridge.errors import DeadlineExceeded

    size, n = 1 << 20, 8  # more than the socket buffers hold: the transfer waits on the peer
    config = load_config({"timeouts": {"transfer_s": 30}, "mooncake": {"waiter_nice": 0}})
    with Peer("mooncake", unique("stopped-peer"), nbytes=n * size) as peer:
        local = Local("mooncake", nbytes=n * size, config=config)
        try:
            pid = local.connect(peer)
            local.buf[: n * size] = pattern(11, n * size)
            lt = local.table(np.arange(n) * size, size)
            rt = local.table(np.arange(n) * size, size, peer=pid, base=peer.base)
            with peer.paused():
                x = local.t.post("write", lt, np.arange(n), rt, np.arange(n))
                c0, t0 = time.process_time(), time.monotonic()
                with pytest.raises(DeadlineExceeded):
                    local.t.wait(x, 1.0)
                share = (time.process_time() - c0) / (time.monotonic() - t0)
            local.t.wait(x, 30)
            local.t.release(x)
            assert share < 0.25, f"waiting took {share:.0%} of a core"
            assert peer.call("digest", 0, n * size) == digest(local.buf[: n * size])
        finally:
            local.close()
