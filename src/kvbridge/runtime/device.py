"""Waiting for device work without trusting it to finish: the one place where the
runtime and the engine adapters meet CUDA streams and events.

- :func:`record_device_event` records an event on the current stream (the engine's,
  in its per-layer hooks): it completes once the kernels queued before it have run.
- :func:`wait_device_event` polls an event (anything with ``query()``, e.g. a
  ``torch.cuda.Event``) until it completes or a deadline passes; polled, never
  ``synchronize()``d, so a wedged stream cannot hold a transfer thread past its deadline.
- :class:`OpsQueue` runs the packed path's pack / unpack: on CPU tensors in the
  caller's thread, synchronously; on a CUDA device on a stream of its own (the engine's
  stream keeps computing meanwhile), and returns once the work has completed.

Who calls: the sender and receiver threads (through
:class:`~kvbridge.runtime.packed.PackedPath`) and the SGLang backend's transfer thread.
torch is imported only where a CUDA device is used.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvbridge.errors import DeadlineExceeded

if TYPE_CHECKING:
    import torch


def record_device_event() -> torch.cuda.Event:
    """A CUDA event recorded on the current stream. Engine thread, in the adapters'
    hooks (one per hooked layer and step, or per forward)."""
    import torch

    event = torch.cuda.Event()
    event.record()
    return event


def wait_device_event(
    event: object,
    deadline: float,
    clock: Callable[[], float] = time.monotonic,
    pause: float = 50e-6,
) -> bool:
    """Poll ``event`` (anything with ``query()``, e.g. a ``torch.cuda.Event`` recorded
    after the kernels that write some KV) until it has completed: True, or until
    ``clock()`` reaches ``deadline``: False.

    >>> class Done:
    ...     def query(self): return True
    >>> wait_device_event(Done(), deadline=0.0)
    True
    """
    while not event.query():  # type: ignore[attr-defined]
        if clock() >= deadline:
            return False
        time.sleep(pause)
    return True


class OpsQueue:
    """Where one worker's packed path runs its ops (see the module docstring).

    Args:
        device: the device of the cache planes and staging buffer.
        timeout_s: the longest a call waits for its device work
            (``timeouts.transfer_s``); past it, :class:`~kvbridge.errors.DeadlineExceeded`.

    One queue per :class:`~kvbridge.runtime.packed.PackedPath`; several threads may call
    :meth:`run` (the sender's and the receiver's), each waiting for its own work only.
    """

    def __init__(self, device: torch.device, timeout_s: float) -> None:
        self.device = device
        self.timeout_s = timeout_s
        self._stream = None
        if device.type == "cuda":
            import torch

            self._stream = torch.cuda.Stream(device=device)

    def run(self, work: Callable[[], None], what: str) -> None:
        """Run ``work`` (which queues ops on the current stream) and return once they have
        completed. ``what`` names the work in the error."""
        if self._stream is None:
            work()
            return
        import torch

        with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
            work()
            done = torch.cuda.Event()
            done.record(self._stream)
        if not wait_device_event(done, time.monotonic() + self.timeout_s):
            raise DeadlineExceeded(
                f"{what} did not complete on {self.device} within timeouts.transfer_s "
                f"({self.timeout_s:g} s): is the GPU stalled?"
            )


__all__ = ["OpsQueue", "record_device_event", "wait_device_event"]
