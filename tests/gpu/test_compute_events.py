"""The prefill's sender writes a layer only once the CUDA event recorded after its
kernels has completed (what the vLLM worker passes on GPU caches): a real event queued
behind a GPU sleep, the runtime over the loopback transport with host caches."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from runtime_pair import L, endpoint, make_cache

pytestmark = pytest.mark.gpu

SLEEP_CYCLES = 500_000_000  # ~0.3 s at H100/H200 clocks: a forward still running


def test_nothing_is_written_before_the_forward_s_cuda_event_completed() -> None:
    p_cache, d_cache = make_cache(1), make_cache(None)
    P, D = endpoint("P", p_cache), endpoint("D", d_cache)
    pa, da = p_cache[0], d_cache[0]
    try:
        D.receiver.expect_push("c", P.address, [1, 2], 20)  # a short prompt: sent after the prefill
        P.sender.track("c", [5, 6], 20)
        for layer in range(L):
            P.sender.layer_done("c", layer, 20)
        torch.cuda._sleep(SLEEP_CYCLES)
        event = torch.cuda.Event()
        event.record()
        P.sender.prefill_done("c", ready=event)
        checks = 0
        while not event.query():
            assert not da.any(), "written while the GPU was still computing"
            checks += 1
            time.sleep(0.001)
        assert checks > 0, "the GPU sleep ended before the first check: raise SLEEP_CYCLES"
        assert D.receiver.wait_finished(5) == (["c"], [])
        np.testing.assert_array_equal(da[:, [1, 2]], pa[:, [5, 6]])
    finally:
        D.close()
        P.close()
