#!/usr/bin/env python3
"""Measure how late a sleeping thread gets the CPU back, as one more process would.

A diagnostic for starved instances on an oversubscribed test machine
(docs/reference/vllm.md, the Mooncake first-contact stall): the probe runs in a
session of its own (with autogroups on, a scheduling group of its own, as each vLLM
instance started by the tests is), at the nice value it was started with, sleeps 10 ms
in a loop and prints, once a second, the worst lateness of that second when it exceeds
``--report`` seconds. Run it beside a test, ``scripts/wakeup-lateness-probe.py``, and
compare its lines with the times in the engines' logs; stop it with Ctrl-C or kill.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--report", type=float, default=0.5, help="print seconds whose worst lateness exceeds this"
    )
    args = parser.parse_args()
    with contextlib.suppress(OSError):  # already a session leader
        os.setsid()
    worst, second_start = 0.0, time.monotonic()
    while True:
        before = time.monotonic()
        time.sleep(0.01)
        worst = max(worst, time.monotonic() - before - 0.01)
        if time.monotonic() - second_start >= 1.0:
            if worst > args.report:
                print(f"{time.strftime('%H:%M:%S')} woke {worst:.2f} s late", flush=True)
            worst, second_start = 0.0, time.monotonic()


if __name__ == "__main__":
    main()
