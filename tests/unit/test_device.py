"""The runtime's device waits (:mod:`kvbridge.runtime.device`): polling an event with a
deadline, and the packed path's ops queue on CPU tensors. The CUDA side of the queue
is tested on a GPU (``tests/gpu/test_packed_path_gpu.py``)."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from runtime_pair import DeviceEvent

from kvbridge.runtime.device import OpsQueue, wait_device_event


def test_waiting_for_a_device_event_returns_once_it_completes() -> None:
    ev = DeviceEvent()
    timer = threading.Timer(0.05, ev.complete)
    timer.start()
    try:
        assert wait_device_event(ev, deadline=time.monotonic() + 10)
    finally:
        timer.cancel()
    assert ev.done and ev.queries > 1  # it polled until then, not once


def test_waiting_for_a_device_event_that_never_completes_stops_at_the_deadline() -> None:
    now = iter(range(1000))
    ev = DeviceEvent()
    assert not wait_device_event(ev, deadline=5, clock=lambda: next(now), pause=0)
    assert ev.queries == 6  # clock 0..4 below the deadline, then 5 reaches it


def test_the_ops_queue_runs_cpu_work_in_the_caller_s_thread_before_returning() -> None:
    queue = OpsQueue(torch.device("cpu"), timeout_s=1)
    ran: list[str] = []
    queue.run(lambda: ran.append(threading.current_thread().name), "packing")
    assert ran == [threading.current_thread().name]


def test_the_ops_queue_passes_the_work_s_errors_through() -> None:
    def bad() -> None:
        raise ValueError("bad block id")

    with pytest.raises(ValueError, match="bad block id"):
        OpsQueue(torch.device("cpu"), timeout_s=1).run(bad, "unpacking")
