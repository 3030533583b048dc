"""What two transport choices cost, each against its alternative in the same run.

``post``: host time of one post over NIXL (two agents in this process, host memory),
descriptors picked at random from a 4096-entry table:

- ``prepared``: indices into tables prepared once (``make_prepped_xfer``), what
  kvbridge posts for whole blocks and head ranges;
- ``adhoc``: the same descriptors built for this post, checked and posted as one-post
  lists (``Transport.adhoc``, NIXL ``initialize_xfer``), what a pair of ranks of
  different TP sizes on a hybrid model posts instead of preparing every block cut into
  its state segments.

Timed from building the descriptors to ``post`` returning; the wait is not timed. Each
sample is the mean of ``CALLS`` posts; methods alternate sample by sample.

``waiter``: how a Mooncake transfer is waited for. ``spin``: the engine's
``batch_transfer_sync``, which waits in a busy loop (kvbridge's way until 2026-12-07,
swapped back into the transport for this comparison); ``poll``: the transport as it is
(a batch of one per descriptor, looked at with growing pauses). One transfer waits
``HOLD_S`` seconds on a peer process stopped with SIGSTOP, beside one busy process per
CPU; measured: this process's CPU time in that window, and how long the transfer takes
to complete once the peer resumes, for each way and ``mooncake.waiter_nice`` of
``WAITS`` (0: the threads that wait keep the process's priority).

``streaming``: what the waiting costs a live transfer. A request's ``LAYERS`` layers
posted at once, one transfer per layer of ``blocks`` blocks at random places (as
layer-wise streaming posts them), to a cache in a second process, then waited for;
for each prompt of ``STREAM_SHAPES`` one transport per way and nice of ``STREAMS``,
alive side by side and timed alternately in the same run: the request's time and
this process's CPU time over it.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import numpy as np

SIZES = (10, 100, 1000)
"""Descriptors per post."""
CALLS = 50
"""Posts per timed sample."""
TABLE = 4096
"""Descriptors in the prepared tables (4 KiB each)."""
WAITS = (("spin", 0), ("spin", 10), ("spin", 19), ("poll", 10))
"""(way of waiting, ``waiter_nice``) pairs of the ``waiter`` section."""
HOLD_S = 2.0
"""How long the batch waits on the stopped peer while CPU time is counted."""


def _descs(base: int, rows: np.ndarray, size: int) -> np.ndarray:
    out = np.zeros((rows.size, 3), dtype=np.uint64)
    out[:, 0] = np.uint64(base) + rows.astype(np.uint64) * np.uint64(size)
    out[:, 1] = size
    return out


def post_costs(reps: int, log: Callable[[str], None]) -> list[dict]:
    from kvbridge.config import load_config
    from kvbridge.transports.registry import create_transport

    cfg = load_config({})
    a = create_transport("nixl", cfg, agent_name=f"bench-a-{os.getpid()}", memory="host")
    b = create_transport("nixl", cfg, agent_name=f"bench-b-{os.getpid()}", memory="host")
    size = 4096
    src, dst = np.ones(TABLE * size, np.uint8), np.zeros(TABLE * size, np.uint8)
    try:
        a.register([(src.ctypes.data, src.nbytes)])
        b.register([(dst.ctypes.data, dst.nbytes)])
        peer = a.add_peer(b.metadata())
        b.add_peer(a.metadata())
        every = np.arange(TABLE)
        lt, rt = (
            a.prepare(_descs(src.ctypes.data, every, size)),
            a.prepare(_descs(dst.ctypes.data, every, size), peer=peer),
        )
        rng = np.random.default_rng(0)

        def one(method: str, n: int) -> float:
            idx = rng.choice(TABLE, n, replace=False).astype(np.int32)
            t0 = time.perf_counter()
            if method == "prepared":
                x = a.post("write", lt, idx, rt, idx)
            else:
                rows = np.arange(n, dtype=np.int32)
                local, remote = (
                    a.adhoc(_descs(src.ctypes.data, idx, size)),
                    a.adhoc(_descs(dst.ctypes.data, idx, size), peer=peer),
                )
                x = a.post("write", local, rows, remote, rows)
            took = time.perf_counter() - t0
            a.wait(x, 30)
            a.release(x)
            return took

        results = []
        for n in SIZES:
            samples: dict[str, list[float]] = {"prepared": [], "adhoc": []}
            for _ in range(reps):
                for method in samples:
                    samples[method].append(sum(one(method, n) for _ in range(CALLS)) / CALLS * 1e6)
            med = {m: statistics.median(s) for m, s in samples.items()}
            log(
                f"post of {n} descriptors: prepared {med['prepared']:.0f} us, adhoc "
                f"{med['adhoc']:.0f} us"
            )
            results.append(
                {
                    "descriptors": n,
                    "us_per_post": med,
                    "samples_us": samples,
                    "adhoc_vs_prepared": med["adhoc"] / med["prepared"],
                }
            )
        return results
    finally:
        a.close()
        b.close()


def _wait_by(transport: object, wait: str) -> None:
    """Make a Mooncake ``transport`` wait its transfers' way ``wait``: ``poll`` leaves it
    as it is; ``spin`` swaps in the engine's busy-waiting ``batch_transfer_sync``."""
    if wait == "spin":

        def spin(engine, endpoint, src, dst, length, opcode) -> int:
            return engine.batch_transfer_sync(endpoint, src, dst, length, opcode, None)

        transport._move = spin  # type: ignore[attr-defined]


def waiter_costs(reps: int, log: Callable[[str], None]) -> list[dict]:
    from kvbridge.config import load_config
    from kvbridge.transports.testing import Local, Peer, unique

    hogs = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"])
        for _ in range(os.cpu_count() or 1)
    ]
    samples: dict[tuple[str, int], list[tuple[float, float]]] = {w: [] for w in WAITS}
    try:
        for _ in range(reps):
            for wait, nice in WAITS:
                cfg = load_config(
                    {"timeouts": {"transfer_s": 30}, "mooncake": {"waiter_nice": nice}}
                )
                with Peer("mooncake", unique("waiter-peer"), nbytes=8 << 20) as peer:
                    local = Local("mooncake", nbytes=8 << 20, config=cfg)
                    try:
                        _wait_by(local.t, wait)
                        pid = local.connect(peer)
                        size = 1 << 20
                        lt = local.table(np.arange(8) * size, size)
                        rt = local.table(np.arange(8) * size, size, peer=pid, base=peer.base)
                        with peer.paused():
                            c0 = time.process_time()
                            x = local.t.post("write", lt, np.arange(8), rt, np.arange(8))
                            time.sleep(HOLD_S)  # the window measured, not a synchronisation
                            cpu = time.process_time() - c0
                        t0 = time.monotonic()
                        local.t.wait(x, 30)
                        samples[wait, nice].append((cpu, time.monotonic() - t0))
                    finally:
                        local.close()
                log(
                    f"{wait} at nice {nice}: {cpu:.2f} s CPU in {HOLD_S} s, done "
                    f"{samples[wait, nice][-1][1] * 1e3:.0f} ms after the peer resumed"
                )
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    return [
        {
            "wait": wait,
            "nice": nice,
            "busy_processes": len(hogs),
            "hold_s": HOLD_S,
            "cpu_share": statistics.median(c for c, _ in s) / HOLD_S,
            "resume_ms": statistics.median(r for _, r in s) * 1e3,
            "samples": [{"cpu_s": c, "resume_s": r} for c, r in s],
        }
        for (wait, nice), s in samples.items()
    ]


LAYERS = 32
STREAM_SHAPES = (("long", 64, 64 << 10), ("short", 2, 16 << 10))
"""(prompt, blocks per layer, block bytes): a long prompt's layers, and a short one's (a
128-token prompt of a small model, per layer)."""
STREAMS = (("spin", 0), ("spin", 10), ("poll", 10))
"""(way of waiting, ``waiter_nice``) of the transports compared in ``streaming``."""


def streaming_costs(reps: int, log: Callable[[str], None]) -> list[dict]:
    return [r for shape in STREAM_SHAPES for r in _streaming(*shape, reps, log)]


def _streaming(
    prompt: str, blocks: int, size: int, reps: int, log: Callable[[str], None]
) -> list[dict]:
    from kvbridge.config import load_config
    from kvbridge.transports.testing import Local, Peer, unique

    slots = 2 * LAYERS * blocks
    rng = np.random.default_rng(1)
    times: dict[tuple[str, int], list[tuple[float, float]]] = {w: [] for w in STREAMS}
    with Peer("mooncake", unique("stream-peer"), nbytes=slots * size) as peer:
        sides = {}
        try:
            for wait, nice in STREAMS:
                local = Local(
                    "mooncake",
                    nbytes=slots * size,
                    config=load_config({"mooncake": {"waiter_nice": nice}}),
                )
                _wait_by(local.t, wait)
                pid = local.connect(peer)
                every = np.arange(slots)
                sides[wait, nice] = (
                    local,
                    local.table(every * size, size),
                    local.table(every * size, size, peer=pid, base=peer.base),
                )
            for _ in range(reps):
                for key, (local, lt, rt) in sides.items():
                    picks = [
                        rng.choice(slots, blocks, replace=False).astype(np.int32)
                        for _ in range(LAYERS)
                    ]
                    c0, t0 = time.process_time(), time.perf_counter()
                    xs = [local.t.post("write", lt, p, rt, p) for p in picks]
                    for x in xs:
                        local.t.wait(x, 60)
                    times[key].append((time.perf_counter() - t0, time.process_time() - c0))
                    for x in xs:
                        local.t.release(x)
        finally:
            for local, _, _ in sides.values():
                local.close()
    nbytes = LAYERS * blocks * size
    out = []
    for (wait, nice), ts in times.items():
        took = statistics.median(t for t, _ in ts)
        cpu = statistics.median(c for _, c in ts)
        log(
            f"{prompt} prompt, {LAYERS} layer transfers, {wait} at nice {nice}: "
            f"{took * 1e3:.1f} ms, {cpu * 1e3:.1f} ms CPU (medians of {reps})"
        )
        out.append(
            {
                "prompt": prompt,
                "wait": wait,
                "nice": nice,
                "blocks": blocks,
                "block_bytes": size,
                "nbytes": nbytes,
                "samples": [{"s": t, "cpu_s": c} for t, c in ts],
                "median_ms": took * 1e3,
                "median_cpu_ms": cpu * 1e3,
                "median_gbps": nbytes / took / 1e9,
            }
        )
    return out


def run(reps: int, log: Callable[[str], None]) -> dict:
    return {
        "post": post_costs(reps, log),
        "waiter": waiter_costs(max(1, reps // 3), log),
        "streaming": streaming_costs(reps, log),
    }
