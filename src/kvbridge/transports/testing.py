"""A transport in another process, driven over a pipe: the far side for the
conformance suite, the benchmarks and ``kvbridge doctor``.

:class:`Peer` spawns :func:`serve` in a fresh interpreter (``spawn``), which creates a
real transport, registers a buffer and then answers commands. Every call has a
deadline: a peer that stops answering raises ``TimeoutError`` instead of hanging the
caller. Not used by the engine integrations.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import multiprocessing as mp
import os
import signal
import threading
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from typing_extensions import Self

_names = itertools.count()


def unique(prefix: str) -> str:
    """An agent name no other transport of this machine uses right now."""
    return f"{prefix}-{os.getpid()}-{next(_names)}"


def pattern(seed: int, nbytes: int) -> np.ndarray:
    """Deterministic pseudo-random bytes; both processes can regenerate them."""
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def digest(buf: np.ndarray) -> str:
    return hashlib.sha256(memoryview(np.ascontiguousarray(buf))).hexdigest()


def os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def os_thread_names() -> list[str]:
    """Names of this process's OS threads (what a leak report should show)."""
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # the thread exited meanwhile
            pass
    return sorted(names)


def settled_os_threads(quiet: float = 0.5, limit: float = 10.0) -> int:
    """The OS thread count once it has not changed for ``quiet`` seconds (at most
    ``limit``): some libraries start threads in the background after their import
    returns, and on a loaded machine those came after a baseline taken at once (seen: 3
    threads at the baseline, 6 a moment later, reported as a leak of the transport)."""
    deadline = time.monotonic() + limit
    count, since = os_threads(), time.monotonic()
    while time.monotonic() < deadline and time.monotonic() - since < quiet:
        time.sleep(0.01)
        now = os_threads()
        if now != count:
            count, since = now, time.monotonic()
    return count


def _all_stopped(pid: int) -> bool:
    """Whether every thread of process ``pid`` is in the stopped state (``T``)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):  # the thread exited meanwhile
            continue
        if state not in ("T", "t"):
            return False
    return True


def py_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate())


def serve(conn: Connection, transport: str, agent_name: str, nbytes: int) -> None:
    """Peer process main: create the transport, then answer commands until 'close'."""
    from kvbridge.transports.registry import create_transport, load

    try:
        load(transport)  # threads a backend starts at import are not the transport's to stop
        baseline = (py_threads(), settled_os_threads())
        t = create_transport(transport, None, agent_name=agent_name)
    except Exception as exc:  # noqa: BLE001 (reported to the parent process)
        conn.send(("err", f"{type(exc).__name__}: {exc}"))
        return
    buf = np.zeros(nbytes, dtype=np.uint8)
    t.register([(buf.ctypes.data, buf.nbytes)])
    conn.send(("ok", (t.metadata(), buf.ctypes.data, buf.nbytes)))

    def take(count: int, timeout: float) -> list[tuple[str, bytes]]:
        got: list[tuple[str, bytes]] = []
        deadline = time.monotonic() + timeout
        while len(got) < count:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            got += [(n.peer, n.payload) for n in t.take_notifications(left)]
        return got

    def close() -> dict[str, Any]:
        t.close()
        # C++ threads of the backend exit as the agent/engine is destroyed; give them a
        # bounded moment, polling, before reporting
        deadline = time.monotonic() + 5
        while os_threads() > baseline[1] and time.monotonic() < deadline:
            time.sleep(0.01)
        return {
            "baseline": baseline,
            "after": (py_threads(), os_threads()),
            "os_thread_names": os_thread_names(),
        }

    commands = {
        "add_peer": t.add_peer,
        "fill": lambda seed: buf.__setitem__(slice(None), pattern(seed, buf.nbytes)),
        "zero": lambda: buf.fill(0),
        "digest": lambda off, n: digest(buf[off : off + n]),
        "take": take,
        "close": close,
    }
    while True:
        if not conn.poll(120):  # the test process is gone or stuck: do not linger
            return
        name, args = conn.recv()
        try:
            result = commands[name](*args)
        except Exception as exc:  # noqa: BLE001 (report, keep serving)
            conn.send(("err", f"{type(exc).__name__}: {exc}"))
            continue
        conn.send(("ok", result))
        if name == "close":
            return


class Peer:
    """Handle on a peer process. Use as a context manager or call :meth:`stop`."""

    def __init__(
        self, transport: str, agent_name: str, nbytes: int = 64 << 20, start_timeout: float = 60
    ) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(
            target=serve, args=(child, transport, agent_name, nbytes), daemon=True
        )
        self.process.start()
        child.close()
        self.agent_name = agent_name
        self.metadata, self.base, self.nbytes = self._reply(start_timeout, "start")

    def _reply(self, timeout: float, what: str) -> Any:
        if not self._conn.poll(timeout):
            raise TimeoutError(f"peer {self.agent_name} did not answer {what!r} within {timeout}s")
        try:
            status, value = self._conn.recv()
        except EOFError:
            self.process.join(5)
            raise RuntimeError(
                f"peer {self.agent_name} exited (code {self.process.exitcode}) before answering "
                f"{what!r}"
            ) from None
        if status != "ok":
            raise RuntimeError(f"peer {self.agent_name} failed {what!r}: {value}")
        return value

    def call(self, name: str, *args: Any, timeout: float = 60) -> Any:
        self._conn.send((name, args))
        return self._reply(timeout, name)

    def kill(self) -> None:
        self.process.kill()
        self.process.join(10)

    @contextlib.contextmanager
    def paused(self, timeout: float = 10.0) -> Iterator[None]:
        """Freeze the peer (SIGSTOP) for the ``with`` block, resumed after (SIGCONT).
        Returns only once every thread of the process is stopped (``/proc``, polled):
        ``kill`` returns before that, and on a loaded machine the peer's threads can go
        on for milliseconds, long enough to finish a transfer meant to find it frozen."""
        os.kill(self.process.pid, signal.SIGSTOP)
        try:
            deadline = time.monotonic() + timeout
            while not _all_stopped(self.process.pid):
                if time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"peer {self.agent_name} did not stop within {timeout}s of SIGSTOP"
                    )
                time.sleep(0.001)
            yield
        finally:
            os.kill(self.process.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.process.is_alive():
            with contextlib.suppress(TimeoutError, RuntimeError, OSError, EOFError):
                self.call("close", timeout=30)
            self.process.join(10)
        if self.process.is_alive():
            self.kill()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class Local:
    """Our side: a transport in this process with a registered buffer of ``nbytes``."""

    def __init__(
        self, transport: str, nbytes: int = 64 << 20, agent_name: str | None = None, config=None
    ) -> None:
        from kvbridge.transports.registry import create_transport

        self.t = create_transport(transport, config, agent_name=agent_name or unique("local"))
        self.buf = np.zeros(nbytes, dtype=np.uint8)
        self.reg = self.t.register([(self.buf.ctypes.data, self.buf.nbytes)])

    @property
    def base(self) -> int:
        return self.buf.ctypes.data

    def table(
        self,
        offsets: np.ndarray,
        length: int | np.ndarray,
        peer: str | None = None,
        base: int | None = None,
        *,
        adhoc: bool = False,
    ):
        """Prepare descriptors at ``offsets`` from ``base`` (default: ours), each
        ``length`` bytes (one length, or one per offset); ``adhoc``: for one post,
        not prepared (``Transport.adhoc``)."""
        start = self.base if base is None else base
        descs = np.stack(
            [
                np.uint64(start) + np.asarray(offsets).astype(np.uint64),
                np.broadcast_to(np.asarray(length, dtype=np.uint64), (len(offsets),)),
            ],
            axis=1,
        )
        return (self.t.adhoc if adhoc else self.t.prepare)(descs, peer=peer)

    def connect(self, peer: Peer) -> str:
        """Exchange metadata with ``peer`` both ways; returns its peer id."""
        pid = self.t.add_peer(peer.metadata)
        peer.call("add_peer", self.t.metadata())
        return pid

    def close(self) -> None:
        self.t.close()
