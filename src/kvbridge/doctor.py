"""``kvbridge doctor``: which transports work on this machine, and how to fix the rest.

For every registered transport: import it (a failure reports the command that fixes
it), then run a real transfer to a second process on loopback: write, read back,
compare byte for byte, and a notification round trip. Each check has a deadline.
"""

from __future__ import annotations

import os
import platform
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from kvbridge.errors import KVBridgeError
from kvbridge.transports import registry
from kvbridge.transports.testing import Local, Peer, digest, pattern, unique

PROBE_BYTES = 16 << 20
BLOCK = 64 << 10


@dataclass
class Check:
    transport: str
    imports: bool = False
    works: bool = False
    detail: str = ""
    fix: str | None = None
    write_gbps: float | None = None
    notify_ms: float | None = None
    steps: list[str] = field(default_factory=list)


def check_transport(name: str, timeout: float = 60.0) -> Check:
    """Import ``name`` and move bytes through it between two processes."""
    result = Check(name)
    try:
        registry.load(name)
    except KVBridgeError as exc:
        result.detail, result.fix = exc.message, exc.fix
        return result
    result.imports = True
    if name == "loopback":  # in-process double: nothing to check across processes
        result.works, result.detail = True, "in-process test double"
        return result
    loc = None
    try:
        with Peer(name, unique("doctor-peer"), nbytes=PROBE_BYTES, start_timeout=timeout) as peer:
            loc = Local(name, nbytes=PROBE_BYTES, agent_name=unique("doctor"))
            peer_id = loc.connect(peer)
            result.steps.append("metadata exchanged")
            n = PROBE_BYTES // BLOCK
            offsets = np.arange(n) * BLOCK
            lt = loc.table(offsets, BLOCK)
            rt = loc.table(offsets[::-1].copy(), BLOCK, peer=peer_id, base=peer.base)
            loc.buf[:] = pattern(7, PROBE_BYTES)
            start = time.perf_counter()
            x = loc.t.post("write", lt, np.arange(n), rt, np.arange(n), notify=b"kvbridge-doctor")
            loc.t.wait(x, timeout)
            elapsed = time.perf_counter() - start
            loc.t.release(x)
            expected = loc.buf.reshape(n, BLOCK)[::-1].reshape(-1)
            if peer.call("digest", 0, PROBE_BYTES, timeout=timeout) != digest(expected):
                raise KVBridgeError(
                    "bytes written differ from the source", fix="report this as a kvbridge bug"
                )
            result.steps.append(f"wrote {n} x {BLOCK >> 10} KiB, verified")
            got = peer.call("take", 1, timeout, timeout=timeout + 5)
            if got != [(loc.t.agent_name, b"kvbridge-doctor")]:
                raise KVBridgeError(f"notification not delivered exactly once: {got}")
            start = time.perf_counter()
            loc.t.notify(peer_id, b"ping")
            if peer.call("take", 1, timeout, timeout=timeout + 5) != [(loc.t.agent_name, b"ping")]:
                raise KVBridgeError("bare notification not delivered")
            result.notify_ms = round((time.perf_counter() - start) * 1e3, 2)
            loc.buf[:] = 0
            x = loc.t.post("read", lt, np.arange(n), rt, np.arange(n))
            loc.t.wait(x, timeout)
            loc.t.release(x)
            if digest(loc.buf) != digest(pattern(7, PROBE_BYTES)):
                raise KVBridgeError(
                    "bytes read back differ from what was written",
                    fix="report this as a kvbridge bug",
                )
            result.steps.append("read back, verified; notifications delivered")
            result.write_gbps = round(PROBE_BYTES / elapsed / 1e9, 2)
            result.works = True
            result.detail = (
                f"{PROBE_BYTES >> 20} MiB in {n} descriptors, first (cold) write "
                f"{result.write_gbps} GB/s, notification {result.notify_ms} ms"
            )
    except (KVBridgeError, RuntimeError, TimeoutError, OSError) as exc:
        result.detail = f"{type(exc).__name__}: {exc}"
        result.fix = (
            getattr(exc, "fix", None)
            or "see the detail; rerun with MC_LOG_LEVEL=INFO / NIXL_LOG_LEVEL=INFO"
        )
    finally:
        if loc is not None:
            loc.close()
    return result


def environment() -> dict:
    from kvbridge import __version__
    from kvbridge.transports.common import rdma_devices

    return {
        "kvbridge": __version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "rdma_devices": rdma_devices(),
    }


def run(names: list[str] | None = None) -> dict:
    checks = [check_transport(n) for n in (names or registry.available())]
    return {"environment": environment(), "transports": [asdict(c) for c in checks]}


__all__ = ["Check", "check_transport", "environment", "run"]
