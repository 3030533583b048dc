"""A prefill and a decode runtime endpoint in one process, over the loopback transport,
with real numpy KV caches: the helpers of the runtime tests (``tests/unit``) and of
the GPU tests that drive the runtime (``tests/gpu``)."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable

import numpy as np

from kvbridge.config import load_config
from kvbridge.core.layout import CacheGeometry, CacheSpec
from kvbridge.runtime.endpoint import Endpoint
from kvbridge.transports.loopback import LoopbackTransport
from kvbridge.wire.peer_compat import CompatInfo

L, N, BS, H, HD = 4, 48, 16, 2, 32
SPEC = CacheSpec(
    num_layers=L, block_size=BS, num_kv_heads=H, head_dim=HD, dtype="float32", layout="fused"
)
_names = itertools.count()


def make_cache(seed: int | None, spec: CacheSpec = SPEC) -> tuple[np.ndarray, CacheGeometry]:
    shape = (spec.num_layers, N, spec.num_kv_heads, spec.block_size, 2 * spec.head_dim)
    arr = (
        np.random.default_rng(seed).standard_normal(shape, dtype=np.float32)
        if seed is not None
        else np.zeros(shape, np.float32)
    )
    geo = CacheGeometry(
        spec=spec,
        num_blocks=N,
        plane_bases=tuple(arr[i].ctypes.data for i in range(spec.num_layers)),
    )
    return arr, geo


def endpoint(
    role: str,
    arr_geo,
    timeouts: dict | None = None,
    spec: CacheSpec = SPEC,
    planes=None,
    groups: tuple[tuple[int, ...], tuple[int, ...]] = ((), ()),
    engine_id: str | None = None,
    **cfg,
) -> Endpoint:
    """A prefill (``role`` "P"), decode ("D") or both ("PD") endpoint over ``arr_geo``'s cache (the
    array and its geometry) with the config keys ``cfg``; ``planes``: the cache's K and
    V planes per layer, for the packed path (``wire_dtype: fp8``, ``data_path: packed``);
    ``groups``: the layers' KV cache groups and the groups' windows (``CompatInfo``);
    ``engine_id``: the instance's (default: ``role``)."""
    config = load_config({"timeouts": {"receive_s": 5, "transfer_s": 5, **(timeouts or {})}, **cfg})
    _, geo = arr_geo
    compat = CompatInfo.from_spec(
        spec,
        model="m",
        wire_dtype=config.wire_dtype,
        data_path=config.resolved_data_path,
        layer_groups=groups[0],
        group_windows=groups[1],
    )
    name = f"{role}-{next(_names)}"
    return Endpoint(
        config,
        geo,
        compat,
        role if engine_id is None else engine_id,
        send="P" in role,
        receive="D" in role,
        transport=LoopbackTransport(name),
        planes=planes,
    )


def eventually(check: Callable[[], bool], timeout: float = 5.0) -> None:
    """Poll a condition that has no event of its own (bytes landing in memory)."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.002)


class DeviceEvent:
    """A stand-in for a CUDA event recorded after a layer's kernels (``query()``, the
    one method the sender uses): incomplete until :meth:`complete`. ``polled`` is set
    once the sender has queried it while incomplete ``polls`` times."""

    def __init__(self, polls: int = 3) -> None:
        self.done = False
        self.queries = 0
        self.polls = polls
        self.polled = threading.Event()

    def query(self) -> bool:
        if not self.done:
            self.queries += 1
            if self.queries >= self.polls:
                self.polled.set()
        return self.done

    def complete(self) -> None:
        self.done = True

    def polled_again(self, timeout: float = 5.0) -> bool:
        """Wait until the sender has queried it ``polls`` more times (from now)."""
        self.polled.clear()
        self.queries = 0
        return self.polled.wait(timeout)
