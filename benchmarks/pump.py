"""The NIXL notification pump: what it costs when nothing happens, and how soon a
notification gets through.

NIXL has no blocking wait for notifications, so each NIXL transport's pump thread polls
``get_new_notifs`` (which also drives UCX progress for peers' transfers into our
memory). How often depends on what its owners expect (``Transport.add_demand``). Three
modes, each a pair of NIXL transports (a receiver and a sender, peers of each other, in
one process of its own), alternated sample by sample in one run:

- ``always``: no demand probe: polled at the busy pace whatever happens (every 2 ms
  once idle; every transport before demand probes existed);
- ``expecting``: a probe that says something is expected (a decode with receives
  pending, a prefill holding blocks): the same busy pace;
- ``idle``: a probe that says nothing is expected: polled every ``IDLE_INTERVAL``.

Per sample: the process's CPU time over ``IDLE_S`` seconds in which nothing happens,
per transport, as a share of one core; then ``NOTES`` notifications from the sender to
the receiver, each after a random pause of up to ``GAP_S``, timed from ``notify`` to
``take_notifications`` returning it. In ``idle`` mode nobody told the receiver to
expect them: the latency an unexpected notification pays (the runtime wakes the pump
when a receive begins, and keeps it busy until it ends).
"""

from __future__ import annotations

import json
import os
import random
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from report import md_report, measured_on

MODES = ("always", "expecting", "idle")
IDLE_S = 4.0
NOTES = 60
GAP_S = 0.03


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def child(mode: str) -> dict[str, Any]:
    """One sample of ``mode`` (module docstring), in this process."""
    from kvbridge.config import load_config
    from kvbridge.transports.registry import create_transport

    cfg = load_config({})
    pid = os.getpid()
    rx = create_transport("nixl", cfg, agent_name=f"pump-rx-{pid}", memory="host")
    tx = create_transport("nixl", cfg, agent_name=f"pump-tx-{pid}", memory="host")
    try:
        if mode != "always":
            expecting = mode == "expecting"
            for t in (rx, tx):
                t.add_demand(lambda expecting=expecting: expecting)
        peer = tx.add_peer(rx.metadata())
        rx.add_peer(tx.metadata())
        time.sleep(0.5)  # the pumps settle into their idle pace
        steps0 = rx._pump.steps  # type: ignore[attr-defined]
        cpu0, t0 = _cpu_s(), time.perf_counter()
        time.sleep(IDLE_S)
        cpu = _cpu_s() - cpu0
        span = time.perf_counter() - t0
        steps = rx._pump.steps - steps0  # type: ignore[attr-defined]
        rng = random.Random(pid)
        latencies = []
        for i in range(NOTES):
            time.sleep(rng.uniform(0, GAP_S))
            sent = time.perf_counter()
            tx.notify(peer, str(i).encode())
            got: list = []
            while not got:
                got = rx.take_notifications(timeout=1.0)
            latencies.append((time.perf_counter() - sent) * 1e3)
        return {
            "cpu_share_per_transport": cpu / span / 2,
            "pump_steps_per_s": steps / span,
            "latency_ms": latencies,
        }
    finally:
        rx.close()
        tx.close()


def run(reps: int, log: Callable[[str], None]) -> dict[str, Any]:
    """``reps`` samples of each mode, alternated; medians and p99 over them."""
    samples: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    for rep in range(reps):
        for mode in MODES:
            out = subprocess.run(
                [sys.executable, __file__, "--child", mode],
                check=True,
                capture_output=True,
                text=True,
                timeout=120,
            )
            samples[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
        log(f"sample {rep + 1} of {reps} done")
    modes = {}
    for mode, got in samples.items():
        lat = sorted(x for s in got for x in s["latency_ms"])
        modes[mode] = {
            "cpu_share_per_transport": statistics.median(s["cpu_share_per_transport"] for s in got),
            "pump_steps_per_s": statistics.median(s["pump_steps_per_s"] for s in got),
            "latency_median_ms": statistics.median(lat),
            "latency_p99_ms": lat[min(len(lat) - 1, int(0.99 * len(lat)))],
            "samples": got,
        }
        log(
            f"{mode}: {modes[mode]['cpu_share_per_transport']:.2%} of a core per transport "
            f"idle, {modes[mode]['pump_steps_per_s']:.0f} polls/s; notification "
            f"{modes[mode]['latency_median_ms']:.2f} ms median, "
            f"{modes[mode]['latency_p99_ms']:.2f} p99"
        )
    return {"idle_s": IDLE_S, "notes": NOTES, "gap_s": GAP_S, "modes": modes}


def rows(doc: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    head = [
        "mode",
        "CPU per transport, idle (share of a core)",
        "polls/s, idle",
        "notification ms, median",
        "p99",
    ]
    body = [
        [
            mode,
            f"{m['cpu_share_per_transport']:.2%}",
            f"{m['pump_steps_per_s']:.0f}",
            f"{m['latency_median_ms']:.2f}",
            f"{m['latency_p99_ms']:.2f}",
        ]
        for mode, m in doc["modes"].items()
    ]
    return head, body


def markdown(doc: dict[str, Any]) -> str:
    m = doc["machine"]
    head, body = rows(doc)
    intro = (
        f"{measured_on(m)}, nixl "
        f"{m['versions'].get('nixl')}: {doc['reps']} samples per mode, alternated; CPU over "
        f"{doc['idle_s']:.0f} s with nothing happening, {doc['notes']} notifications per "
        "sample (`benchmarks/pump.py` says what each mode is)."
    )
    return md_report(intro, head, body)


def plot(doc: dict[str, Any], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(doc["modes"])
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.2))
    ax1.bar(modes, [100 * doc["modes"][m]["cpu_share_per_transport"] for m in modes])
    ax1.set_ylabel("% of a core per transport, idle")
    ax1.set_title("Idle CPU of the pump")
    lat = [sorted(x for s in doc["modes"][m]["samples"] for x in s["latency_ms"]) for m in modes]
    ax2.boxplot(lat, whis=(1, 99), showfliers=False)
    ax2.set_xticks(range(1, len(modes) + 1), modes)
    ax2.set_ylabel("ms, notify to taken (whiskers p1-p99)")
    ax2.set_title("Notification latency")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__" and sys.argv[1:2] == ["--child"]:
    print(json.dumps(child(sys.argv[2])))
