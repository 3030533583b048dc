"""State-space states between tensor-parallel sizes (:mod:`kvbridge.core.states`),
checked against a straightforward model of how vLLM shards a state: the model's
state as one array per tensor, each rank's block the concatenation of its units of
every section, row by row (replicated units: the rank's ``rank // (tp // units)``).
Every decode rank's block, assembled from every prefill rank's by the segments, must be
that rank's shard byte for byte, each byte written once; and on the runtime (loopback
transport, both flows, both directions), a decode rank of another TP size receives its
attention heads and its shard of every state, and exactly those bytes."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from kvbridge.core.states import (
    Section,
    StateLayout,
    StateTensor,
    state_prefill_ranks,
    state_segments,
)
from kvbridge.errors import IncompatiblePeerError

MAMBA2 = StateLayout(kind="mamba2", tensors=(
    StateTensor("float32", 3, (Section(8, 4), Section(1, 2), Section(1, 2))),
    StateTensor("float32", 1, (Section(8, 6),)),
))  # fmt: skip
MAMBA2_GROUPS_DS = StateLayout(kind="mamba2", tensors=(
    StateTensor("float32", 1, (Section(4, 12), Section(4, 6), Section(4, 6))),
    StateTensor("bfloat16", 1, (Section(4, 10),)),
))  # fmt: skip
GDN = StateLayout(kind="gdn_attn", tensors=(
    StateTensor("bfloat16", 3, (Section(2, 4), Section(2, 4), Section(4, 4))),
    StateTensor("float32", 1, (Section(4, 16),)),
))  # fmt: skip
SHORT_CONV = StateLayout(kind="short_conv", tensors=(StateTensor("float32", 2, (Section(16, 1),)),))
LAYOUTS = {
    "mamba2": MAMBA2,
    "mamba2-groups-ds": MAMBA2_GROUPS_DS,
    "gdn": GDN,
    "short_conv": SHORT_CONV,
}
TP_PAIRS = [(1, 2), (2, 1), (1, 4), (4, 1), (2, 4), (4, 2), (2, 2), (1, 1)]


def model_state(layout: StateLayout, seed: int) -> list[np.ndarray]:
    """The whole model's state, one ``(rows, channels)`` array of random bytes per
    tensor (``channels`` in bytes)."""
    rng = np.random.default_rng(seed)
    out = []
    for t in layout.tensors:
        es = np.dtype(np.float32).itemsize if t.dtype == "float32" else 2
        out.append(
            rng.integers(
                0, 256, (t.rows, sum(s.units * s.width for s in t.sections) * es), dtype=np.uint8
            )
        )
    return out


def shard(layout: StateLayout, state: list[np.ndarray], tp: int, rank: int) -> np.ndarray:
    """Rank ``rank``'s state block at TP ``tp``: per tensor, per row, each section's
    units of the rank."""
    parts = []
    for t, whole in zip(layout.tensors, state, strict=True):
        es = 4 if t.dtype == "float32" else 2
        rows, start = [], 0
        for s in t.sections:
            unit = s.width * es
            if s.units >= tp:
                n = s.units // tp
                first = rank * n
            else:
                n, first = 1, rank // (tp // s.units)
            rows.append(whole[:, start + first * unit : start + (first + n) * unit])
            start += s.units * unit
        parts.append(np.concatenate(rows, axis=1).reshape(-1))
    return np.concatenate(parts)


@pytest.mark.parametrize(("p_tp", "d_tp"), TP_PAIRS)
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_segments_assemble_each_decode_rank_s_shard(name: str, p_tp: int, d_tp: int) -> None:
    layout = LAYOUTS[name]
    state = model_state(layout, seed=p_tp * 10 + d_tp)
    for d in range(d_tp):
        want = shard(layout, state, d_tp, d)
        assert want.size == layout.nbytes(d_tp)
        got = np.zeros_like(want)
        written = np.zeros(want.size, dtype=np.int64)
        for p in range(p_tp):
            src = shard(layout, state, p_tp, p)
            assert src.size == layout.nbytes(p_tp)
            for p_off, d_off, n in state_segments(layout, p_tp, d_tp, p, d):
                got[d_off : d_off + n] = src[p_off : p_off + n]
                written[d_off : d_off + n] += 1
        np.testing.assert_array_equal(got, want, err_msg=f"decode rank {d}")
        assert (written == 1).all(), (
            f"decode rank {d}: bytes written {sorted(set(written.tolist()))} times"
        )


def test_segments_are_merged_where_both_sides_are_contiguous() -> None:
    # equal TP: one segment, the whole block; DS conv and one-section tensors: one per section run
    assert state_segments(MAMBA2, 2, 2, 1, 1) == [(0, 0, MAMBA2.nbytes(2))]
    assert state_segments(SHORT_CONV, 1, 2, 0, 1) == [(32, 0, 32), (96, 32, 32)]
    assert state_prefill_ranks(MAMBA2, 2, 1, 0) == {0, 1} and state_prefill_ranks(
        MAMBA2, 1, 2, 1
    ) == {0}


def test_a_layout_that_does_not_split_is_refused_naming_the_fix() -> None:
    with pytest.raises(IncompatiblePeerError, match="do not split over 3 ranks") as err:
        state_segments(MAMBA2, 1, 3, 0, 0)
    assert "--tensor-parallel-size" in str(err.value)


def test_layouts_round_trip_and_other_descriptions_have_none() -> None:
    for layout in LAYOUTS.values():
        assert StateLayout.decode(layout.encode()) == layout
    assert StateLayout.decode("mamba2 float32(3, 8) conv SD") is None
    assert StateLayout.decode('{"kind": "m", "tensors": [["float32", 0, [[1, 1]]]]}') is None, (
        "zero rows"
    )
    assert len({layout.encode() for layout in LAYOUTS.values()}) == len(LAYOUTS)


@pytest.mark.parametrize(("p_tp", "d_tp"), list(itertools.permutations([1, 2], 2)))
def test_every_prefill_rank_feeds_every_decode_rank_of_a_mamba2_state(p_tp: int, d_tp: int) -> None:
    """Between TP 1 and 2 each pair shares part of the state: x heads split, B and C
    (one group) come from prefill rank 0 when the decode has fewer ranks."""
    for d in range(d_tp):
        assert state_prefill_ranks(MAMBA2, p_tp, d_tp, d) == set(range(p_tp))


# --- the runtime: a hybrid cache between TP sizes over the loopback transport ------------

BS, HD, KV_HEADS, N = 16, 8, 2, 12
_names = itertools.count()


class HybridRank:
    """One worker of a two-layer hybrid model: layer 0 attention (vLLM's CPU layout, the
    model's ``KV_HEADS`` split over ``tp``; KV cache group 1), layer 1 a Mamba2 layer
    (group 0) whose state sits at the start of its blocks. A prefill rank's cache is
    random, its state blocks hold its shard of ``state``; a decode rank's is zeros."""

    def __init__(
        self, role: str, tp: int, rank: int, state: list[np.ndarray] | None = None
    ) -> None:
        from kvbridge.config import load_config
        from kvbridge.core.layout import CacheGeometry, CacheSpec
        from kvbridge.runtime.endpoint import Endpoint
        from kvbridge.transports.loopback import LoopbackTransport
        from kvbridge.wire.peer_compat import CompatInfo

        self.tp, self.rank, self.heads = tp, rank, KV_HEADS // tp
        shape = (2, N, self.heads, BS, 2 * HD)
        rng = np.random.default_rng(100 * tp + rank)
        self.cache = (
            rng.standard_normal(shape, dtype=np.float32)
            if state is not None
            else np.zeros(shape, np.float32)
        )
        if state is not None:
            mine = shard(MAMBA2, state, tp, rank)
            for b in range(N):
                self.state(b)[: mine.size] = mine
        spec = CacheSpec(
            num_layers=2,
            block_size=BS,
            num_kv_heads=self.heads,
            head_dim=HD,
            dtype="float32",
            layout="fused",
        )
        geo = CacheGeometry(
            spec=spec,
            num_blocks=N,
            plane_bases=(self.cache[0].ctypes.data, self.cache[1].ctypes.data),
            layer_bytes=(spec.block_bytes, MAMBA2.nbytes(tp)),
        )
        config = load_config(
            {"timeouts": {"receive_s": 5, "transfer_s": 5, "lease_s": 5, "handshake_s": 3}}
        )
        compat = CompatInfo.from_spec(
            spec,
            model="m",
            tp_size=tp,
            total_kv_heads=KV_HEADS,
            layer_groups=(1, 0),
            group_windows=(0, 0),
            group_states=(MAMBA2.encode(), ""),
        )
        self.ep = Endpoint(
            config,
            geo,
            compat,
            role,
            rank,
            send=role == "P",
            receive=role == "D",
            transport=LoopbackTransport(f"{role}{rank}-{next(_names)}"),
        )

    def state(self, block: int) -> np.ndarray:
        """The bytes of ``block`` of the state layer (a view)."""
        return self.cache[1, block].view(np.uint8).reshape(-1)


@pytest.mark.parametrize("flow", ["push", "pull"])
@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 2), (2, 1)])
def test_a_decode_rank_of_another_tp_size_gets_its_heads_and_its_shard_of_the_state(
    p_tp: int, d_tp: int, flow: str
) -> None:
    from kvbridge.core.blocks import NONE, BlockTable

    state = model_state(MAMBA2, seed=7)
    ps = [HybridRank("P", p_tp, r, state) for r in range(p_tp)]
    ds = [HybridRank("D", d_tp, r) for r in range(d_tp)]
    try:
        # 40 tokens: 3 blocks, the state at the last
        n, p_attn, d_attn, p_state, d_state = (
            40,
            [1, 2, 3],
            [5, 6, 7],
            9,
            10,
        )
        p_blocks = BlockTable.grouped([[NONE, NONE, p_state], p_attn])
        d_blocks = BlockTable.grouped([[NONE, NONE, d_state], d_attn])
        for d in ds:
            sources = [
                p.ep.address
                for p in ps
                if p.rank in state_prefill_ranks(MAMBA2, p_tp, d_tp, d.rank)
            ]
            assert len(sources) == max(1, p_tp // d_tp)
        for p in ps:
            p.ep.sender.track("s", p_blocks, n, pull=flow == "pull")
            p.ep.sender.layer_done("s", 0, n)
            p.ep.sender.prefill_done("s")
        for d in ds:
            if flow == "push":
                d.ep.receiver.expect_push("s", [p.ep.address for p in ps], d_blocks, n)
            else:
                d.ep.receiver.expect_pull(
                    "s", [p.ep.address for p in ps], [p.ep.epoch for p in ps], p_blocks, d_blocks, n
                )
        for d in ds:
            assert d.ep.receiver.wait_finished(5) == (["s"], [])
        for p in ps:
            assert p.ep.sender.wait_released(5) == ["s"]
        per = KV_HEADS // d_tp
        # (blocks, all heads, tokens, 2 x dim)
        whole = np.concatenate([p.cache[0, p_attn] for p in ps], axis=1)
        for d in ds:
            np.testing.assert_array_equal(
                d.cache[0, d_attn],
                whole[:, d.rank * per : (d.rank + 1) * per],
                err_msg=f"decode rank {d.rank}: attention",
            )
            mine = shard(MAMBA2, state, d_tp, d.rank)
            np.testing.assert_array_equal(
                d.state(d_state)[: mine.size], mine, err_msg=f"decode rank {d.rank}: state"
            )
            assert not d.state(d_state)[mine.size :].any(), "bytes beyond the state moved"
            others = [b for b in range(N) if b not in d_attn]
            assert (
                not d.cache[0, others].any() and not np.delete(d.cache[1], d_state, axis=0).any()
            ), "bytes outside the destination blocks"
            expected = 3 * per * BS * 2 * HD * 4 + MAMBA2.nbytes(d_tp)
            assert d.ep.stats.take().bytes_received == expected
    finally:
        for r in (*ps, *ds):
            r.ep.close()


# --- the vLLM adapter: a state layout derived from the model's shapes at TP 1 ------------


class _Config:
    """The parts of a ``VllmConfig`` the shape functions read."""

    def __init__(self, tp: int) -> None:
        self.parallel_config = type("P", (), {"tensor_parallel_size": tp})()
        self.model_config = object()
        self.num_speculative_tokens = 0


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("groups", [1, 4])
def test_the_vllm_adapter_derives_a_mamba2_layout_that_is_the_same_at_every_tp(
    monkeypatch: pytest.MonkeyPatch, tp: int, groups: int
) -> None:
    """vLLM's own shape calculator gives the rank's shapes at ``tp``; the adapter asks
    the model class again at TP 1 and finds x, B and C; the layout's shard sizes at
    ``tp`` are the rank's shapes, and it does not depend on ``tp``."""
    import torch
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator
    from vllm.model_executor.model_loader import utils as loader_utils

    from kvbridge.adapters.vllm import compat

    class Model:
        @classmethod
        def get_mamba_state_shape_from_config(cls, vllm_config):
            return MambaStateShapeCalculator.mamba2_state_shape(
                tp_world_size=vllm_config.parallel_config.tensor_parallel_size,
                intermediate_size=256,
                n_groups=groups,
                num_heads=8,
                head_dim=32,
                state_size=16,
                conv_kernel=4,
            )

    monkeypatch.setattr(loader_utils, "get_model_cls", lambda model_config: Model)

    def spec(tp: int, shapes=None):
        return type(
            "Spec",
            (),
            {
                "mamba_type": "mamba2",
                "dtypes": (torch.float32, torch.float32),
                "shapes": shapes or Model.get_mamba_state_shape_from_config(_Config(tp)),
            },
        )()

    text = compat.state_layout(spec(tp), _Config(tp))
    layout = StateLayout.decode(text)
    assert layout is not None, text
    assert [s.units for s in layout.tensors[0].sections] == [8, groups, groups]
    assert layout.nbytes(tp) == sum(4 * np.prod(shape) for shape in spec(tp).shapes)
    assert text == compat.state_layout(spec(1), _Config(1)), "the layout depends on the TP size"
    odd = ((3, 999), spec(tp).shapes[1])  # shapes the layout does not explain
    assert StateLayout.decode(compat.state_layout(spec(tp, odd), _Config(tp))) is None


def test_a_pair_of_other_tp_sizes_prepares_no_table_and_forgetting_it_drops_the_peer() -> None:
    """Such a pair addresses each transfer's segments alone: shaking hands prepares
    nothing per peer on either side (a table of every block cut into its segments would
    be ~10x a slot table per pair), and a transfer still moves exactly the shards."""
    p, d = HybridRank("P", 1, 0, model_state(MAMBA2, seed=3)), HybridRank("D", 2, 1)
    tables = {r: len(r.ep.node.transport._tables) for r in (p, d)}
    try:
        peer = d.ep.node.connect(p.ep.address)
        assert peer.cut is not None and peer.table is None
        assert {r: len(r.ep.node.transport._tables) for r in (p, d)} == tables
        from kvbridge.core.blocks import BlockTable

        local, rows, remote, ridx = d.ep.node.plan(
            peer, BlockTable.grouped([[1, 2], [5, 6]]), BlockTable.grouped([[3, 4], [7, 0]])
        )
        assert not local.prepared and not remote.prepared and remote.peer == peer.agent
        assert rows.tolist() == ridx.tolist() == list(range(len(local)))
        assert (
            int(local.descs[:, 1].sum())
            == int(remote.descs[:, 1].sum())
            == 2 * sum(peer.cut.layer_bytes(l) for l in range(2))
        )
        from kvbridge.errors import InvalidDescriptorError

        none = d.ep.node.plan(
            peer,
            BlockTable.grouped([[1, 2], [5, 6]]),
            BlockTable.grouped([[3, 4], [7, 0]]),
            layers=[],
        )
        assert len(none[1]) == 0
        with pytest.raises(InvalidDescriptorError, match="empty transfer"):
            # as for any plan that moves nothing
            d.ep.node.transport.post("read", *none)
        d.ep.node.forget(p.ep.address)
        assert peer.agent not in d.ep.node.transport.peers and not d.ep.node.knows(peer.id)
    finally:
        d.ep.close()
        p.ep.close()


def _geo(num_blocks: int = 3):
    from kvbridge.core.layout import CacheGeometry, CacheSpec

    spec = CacheSpec(
        num_layers=2, block_size=4, num_kv_heads=1, head_dim=8, dtype="float16", layout="fused"
    )
    return CacheGeometry(spec=spec, num_blocks=num_blocks, plane_bases=(0x1000, 0x2000), device=5)


def test_a_cut_addresses_each_segment_of_each_slot_on_both_sides() -> None:
    from kvbridge.core.plan import Cut

    geo = _geo()
    cut = Cut([[(0, 32, 16)], [(0, 8, 8), (64, 96, 8)]])
    slots = geo.slots([2, 0], [0, 1])  # layer 0 blocks 2, 0; layer 1 blocks 2, 0
    want_local, want_remote = [], []
    for slot in slots.tolist():  # one slot at a time, from the geometry's own addressing
        for a, b, n in cut.segments[slot // geo.num_blocks]:
            want_local.append((geo.slot_address(slot) + a, n, 5))
            want_remote.append((geo.slot_address(slot) + b, n, 5))
    assert [tuple(r) for r in cut.descs(geo, slots).tolist()] == want_local
    assert [tuple(r) for r in cut.descs(geo, slots, remote=True).tolist()] == want_remote
    assert cut.counts == [1, 2] and cut.layer_bytes(1) == 16


def test_a_cut_refuses_segments_outside_a_block_or_of_other_layers() -> None:
    from kvbridge.core.plan import Cut
    from kvbridge.errors import PlanError

    geo = _geo()
    Cut([[(0, 0, 16)], [(120, 0, 8)]]).check(geo, remote=False)
    with pytest.raises(PlanError, match="outside a block of 128 bytes"):
        Cut([[(0, 0, 16)], [(120, 0, 16)]]).check(geo, remote=False)
    with pytest.raises(PlanError, match="outside a block of 128 bytes"):
        Cut([[(0, 120, 16)], [(0, 0, 8)]]).check(geo, remote=True)
    with pytest.raises(PlanError, match="a cut of 1 layers for a cache of 2"):
        Cut([[(0, 0, 16)]]).check(geo, remote=False)
