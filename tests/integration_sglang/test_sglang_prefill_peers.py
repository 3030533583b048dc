"""The SGLang prefill adds a decode's registration on its control thread, which also
takes every room's destination: adding the peer must not wait on that decode. On the
prefill's own method (no servers), with a real Mooncake transport (the backend whose
``add_peer`` can wait on the peer) and a decode process that cannot answer (SIGSTOPped).
Runs in .venv-sglang (``prefill`` imports SGLang's classes)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

try:
    from kvbridge.adapters.sglang import messages as wire
    from kvbridge.adapters.sglang.prefill import PrefillSide
except ImportError as exc:  # pragma: no cover
    raise RuntimeError(
        "tests/integration_sglang needs .venv-sglang: bash scripts/setup-sglang.sh"
    ) from exc

from kvbridge.adapters.sglang.layout import AuxLayout
from kvbridge.core.layout import CacheGeometry, CacheSpec
from kvbridge.transports.testing import Local, Peer, unique

pytest.importorskip("mooncake.engine", reason="Mooncake is part of the SGLang suite's environment")


def _registration(decode: Peer) -> wire.Registration:
    """A registration whose cache and aux rows lie in the decode process's buffer."""
    spec = CacheSpec(
        num_layers=2, block_size=16, num_kv_heads=1, head_dim=64, dtype="uint8", layout="nhd"
    )
    planes = spec.num_layers * spec.planes_per_layer
    geometry = CacheGeometry(
        spec=spec,
        num_blocks=8,
        plane_bases=tuple(decode.base + i * 8 * spec.block_bytes for i in range(planes)),
    )
    aux = AuxLayout(ptrs=(decode.base + planes * 8 * spec.block_bytes,), item_lens=(64,), rows=3)
    return wire.Registration(
        agent=decode.agent_name,
        epoch="e",
        transport="mooncake",
        transport_md=decode.metadata,
        geometry=geometry,
        aux=aux,
        ip="127.0.0.1",
        port=5,
        prefix_cache=False,
        page_size=16,
    )


def test_a_decode_that_does_not_answer_does_not_hold_the_control_thread() -> None:
    with Peer("mooncake", unique("sglang-decode"), nbytes=1 << 20) as decode:
        ours = Local("mooncake", nbytes=1 << 20)
        reg = _registration(decode)
        prefill = SimpleNamespace(
            transport=ours.t,
            peers={},
            _peers_lock=threading.Lock(),
            _refused={},
            aux_layout=reg.aux,
            _pairing=lambda reg: None,
            _state_cut=lambda reg: None,
            check_peer_aux_buffer_count=lambda *a: None,
            _drop_peer=lambda agent: None,
        )
        try:
            with decode.paused():
                start = time.monotonic()
                PrefillSide._add_peer(prefill, reg)
                took = time.monotonic() - start
            assert took < 2, (
                f"registering a stopped decode held the prefill's control thread {took:.1f}s"
            )
            assert decode.agent_name in prefill.peers, (
                "the decode is registered; a dead one shows at its first write"
            )
        finally:
            ours.close()
