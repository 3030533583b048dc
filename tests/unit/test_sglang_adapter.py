"""The SGLang backend's pure parts (no SGLang needed): KV pool geometry checked against
numpy buffers shaped like SGLang's MHA pool, metadata rows, messages, configuration."""

from __future__ import annotations

import ctypes
import json
import time
from types import SimpleNamespace

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from kvbridge.adapters.sglang import compat
from kvbridge.adapters.sglang.lanes import RoomLanes, lane_room
from kvbridge.adapters.sglang.lifecycle import (
    EpochWatcher,
    InstanceEpoch,
    Tombstones,
    Verdict,
    decode_epoch,
    encode_epoch,
    rank_key,
)
from kvbridge.adapters.sglang.metrics import PrometheusExport, exporter
from kvbridge.adapters.sglang.pools import (
    check_windows,
    kv_geometry,
    pages_differ,
    pool_states,
    transfer_pages,
    window_overlap,
)
from kvbridge.adapters.sglang.settings import CONFIG_ENV, config_from_env, transfer_page_size
from kvbridge.core.layout import CacheSpec
from kvbridge.core.rows import RowLayout, paired_count
from kvbridge.core.states import Section, StateTensor
from kvbridge.errors import ConfigError, IncompatiblePeerError, PlanError, WireError
from kvbridge.runtime.stats import StatsSnapshot
from kvbridge.wire import room_messages as wire
from kvbridge.wire.auth import FRESH_S, ReplayGuard, stamp

LAYERS, PAGES, PAGE, HEADS, DIM = 3, 9, 4, 2, 8


def sglang_pool(seed: int):
    """Per-layer K and V buffers of ``(PAGES * PAGE, HEADS, DIM)`` float16, and KVArgs'
    lists for them (``[K_0 .. K_{L-1}, V_0 .. V_{L-1}]``)."""
    rng = np.random.default_rng(seed)
    k = [rng.standard_normal((PAGES * PAGE, HEADS, DIM)).astype(np.float16) for _ in range(LAYERS)]
    v = [rng.standard_normal((PAGES * PAGE, HEADS, DIM)).astype(np.float16) for _ in range(LAYERS)]
    bufs = k + v
    ptrs = [b.ctypes.data for b in bufs]
    lens = [b.nbytes for b in bufs]
    item = [PAGE * HEADS * DIM * 2] * len(bufs)
    return k, v, ptrs, lens, item


def test_slots_address_the_pages_numpy_indexing_gives() -> None:
    k, v, ptrs, lens, item = sglang_pool(0)
    geo = kv_geometry(page_size=PAGE, ptrs=ptrs, lens=lens, item_lens=item)
    assert geo.spec.num_layers == LAYERS and geo.num_blocks == PAGES
    table = geo.slot_table()
    pages = [5, 2, 7]
    slots = geo.slots(pages)
    # layer-major, then K/V, then position in the page list
    expected = [
        (plane[layer][p * PAGE : (p + 1) * PAGE]).tobytes()
        for layer in range(LAYERS)
        for plane in (k, v)
        for p in pages
    ]
    got = [ctypes.string_at(int(table[s, 0]), int(table[s, 1])) for s in slots]
    assert got == expected


def test_an_mla_pool_is_one_latent_buffer_per_layer() -> None:
    """SGLang's MLA pool: ``kv_data_ptrs`` is one ``(PAGES * PAGE, 1, latent)`` buffer per
    layer; its pages are addressed as numpy indexing gives them."""
    rng = np.random.default_rng(5)
    latent = 576
    bufs = [
        rng.standard_normal((PAGES * PAGE, 1, latent)).astype(np.float32) for _ in range(LAYERS)
    ]
    geo = kv_geometry(
        page_size=PAGE,
        ptrs=[b.ctypes.data for b in bufs],
        lens=[b.nbytes for b in bufs],
        item_lens=[PAGE * latent * 4] * LAYERS,
        mla=True,
    )
    assert (geo.spec.layout, geo.spec.planes_per_layer, geo.spec.num_layers, geo.num_blocks) == (
        "latent",
        1,
        LAYERS,
        PAGES,
    )
    table = geo.slot_table()
    pages = [8, 0, 3]
    got = [ctypes.string_at(int(table[s, 0]), int(table[s, 1])) for s in geo.slots(pages)]
    assert got == [
        bufs[layer][p * PAGE : (p + 1) * PAGE].tobytes() for layer in range(LAYERS) for p in pages
    ]
    # an MHA pool's two buffers per layer are not an MLA pool's one: the spec differs, so
    # a peer of the other kind is refused at registration
    _, _, ptrs, lens, item = sglang_pool(6)
    assert kv_geometry(page_size=PAGE, ptrs=ptrs, lens=lens, item_lens=item).spec != geo.spec


def test_two_pools_pair_position_by_position() -> None:
    """Slots of a source and a destination pool of different sizes pair up page for page."""
    _, _, ptrs, lens, item = sglang_pool(1)
    src = kv_geometry(page_size=PAGE, ptrs=ptrs, lens=lens, item_lens=item)
    dst = kv_geometry(
        page_size=PAGE, ptrs=[p + 10**6 for p in ptrs], lens=[n * 2 for n in lens], item_lens=item
    )
    assert src.spec == dst.spec and dst.num_blocks == 2 * PAGES
    a, b = src.slots([1, 2]), dst.slots([7, 3])
    assert len(a) == len(b) == LAYERS * 2 * 2
    for i, j in zip(a, b, strict=True):
        # same (layer, plane)
        assert divmod(int(i), src.num_blocks)[0] == divmod(int(j), dst.num_blocks)[0]


@pytest.mark.parametrize(
    "ptrs, lens, item",
    [
        ([1, 2, 3], [64] * 3, [16] * 3),  # odd number of buffers
        ([1, 2], [64, 128], [16, 16]),  # layers differ in length
        ([1, 2], [64, 64], [16, 32]),  # layers differ in page bytes
    ],
)
def test_unsupported_pools_are_refused(ptrs, lens, item) -> None:
    with pytest.raises(PlanError, match="MHA"):
        kv_geometry(page_size=4, ptrs=ptrs, lens=lens, item_lens=item)


def test_a_pool_with_other_state_than_a_window_or_states_is_refused_naming_sglangs_backends() -> (
    None
):
    import enum

    class StateType(enum.Enum):  # SGLang's names (sglang.srt.disaggregation.utils)
        SWA = "swa"
        MAMBA = "mamba"
        DSA = "dsa"

    # an MHA or MLA pool: SGLang registers no state component
    assert pool_states([]) is None
    assert pool_states(None) is None
    assert pool_states([StateType.SWA]) == "swa"
    assert pool_states([StateType.MAMBA]) == "mamba"
    for state in ([StateType.SWA, StateType.MAMBA], [StateType.DSA]):
        names = ", ".join(s.name for s in state)
        with pytest.raises(
            PlanError, match=rf"state that kvbridge does not move yet \({names}\)"
        ) as info:
            pool_states(state)
        assert "--disaggregation-transfer-backend mooncake or nixl" in str(info.value)


def test_sliding_window_layers_pair_only_with_the_same_pages_on_both_sides() -> None:
    _, _, ptrs, lens, item = sglang_pool(2)
    window = kv_geometry(page_size=PAGE, ptrs=ptrs, lens=lens, item_lens=item)
    check_windows(None, None)  # neither side has window layers
    check_windows(window, window)
    with pytest.raises(
        IncompatiblePeerError, match="has sliding-window layers and this prefill's has none"
    ):
        check_windows(window, None)
    with pytest.raises(
        IncompatiblePeerError, match="has no sliding-window layers and this prefill's has"
    ):
        check_windows(None, window)
    other = msgspec.structs.replace(
        window, spec=msgspec.structs.replace(window.spec, head_dim=window.spec.head_dim // 2)
    )
    with pytest.raises(IncompatiblePeerError, match=r"sliding-window pages .* differ"):
        check_windows(other, window)
    # the packed path: rows may differ (another TP size), layers and pages may not
    check_windows(other, window, packed=True)
    n = len(ptrs) // 2  # [K..., V...]: one layer fewer
    fewer = kv_geometry(
        page_size=PAGE,
        ptrs=ptrs[: n - 1] + ptrs[n : 2 * n - 1],
        lens=lens[2:],
        item_lens=item[2:],
    )
    larger = kv_geometry(page_size=2 * PAGE, ptrs=ptrs, lens=lens, item_lens=[2 * i for i in item])
    for theirs in (fewer, larger):
        with pytest.raises(IncompatiblePeerError, match="sliding-window layers in pages of"):
            check_windows(theirs, window, packed=True)
    with pytest.raises(IncompatiblePeerError, match="has no sliding-window layers"):
        check_windows(None, window, packed=True)


def test_aux_rows() -> None:
    ids = np.zeros((6, 16), dtype=np.int32)
    room = np.zeros((6, 8), dtype=np.uint64)
    aux = RowLayout.build(
        ptrs=[ids.ctypes.data, room.ctypes.data], lens=[ids.nbytes, room.nbytes], item_lens=[64, 64]
    )
    ids[4, 0], room[4, 0] = 123, 99
    table = aux.table()
    got = [ctypes.string_at(int(table[s, 0]), int(table[s, 1])) for s in aux.slots(4)]
    assert got == [ids[4].tobytes(), room[4].tobytes()]
    assert aux.regions() == [(ids.ctypes.data, ids.nbytes), (room.ctypes.data, room.nbytes)]
    with pytest.raises(PlanError):
        aux.slots(6)


def test_aux_pairing_stops_at_the_first_difference() -> None:
    a = RowLayout(ptrs=(1, 2, 3), item_lens=(64, 64, 128), rows=4)
    assert paired_count(a, RowLayout(ptrs=(9, 8), item_lens=(64, 64), rows=8)) == 2
    assert paired_count(a, RowLayout(ptrs=(9, 8, 7), item_lens=(64, 32, 128), rows=8)) == 1


def test_messages_round_trip_and_refuse_foreign_frames() -> None:
    _, _, ptrs, lens, item = sglang_pool(2)
    geo = kv_geometry(page_size=PAGE, ptrs=ptrs, lens=lens, item_lens=item)
    reg = wire.Registration(
        agent="sglang-decode-r0-abc",
        epoch="abc",
        transport="nixl",
        transport_md=b"\x00md",
        geometry=geo,
        aux=RowLayout(ptrs=(1,), item_lens=(64,), rows=3),
        ip="127.0.0.1",
        port=5555,
    )
    assert wire.decode(wire.encode(reg)) == reg
    # a sliding-window pool's registration and destination carry its window layers' pages
    windowed = msgspec.structs.replace(reg, window=geo)
    assert wire.decode(wire.encode(windowed)) == windowed
    # a state-space pool's registration carries its state tensors, a destination its slot
    stateful = msgspec.structs.replace(
        reg,
        states=RowLayout(ptrs=(4096, 8192), item_lens=(24, 96), rows=3),
        state_split=(
            StateTensor("uint8", 1, (Section(6, 4),)),
            StateTensor("uint8", 1, (Section(2, 48),)),
        ),
    )
    assert wire.decode(wire.encode(stateful)) == stateful
    dst = wire.Destination(
        room=3,
        agent="d",
        ip="127.0.0.1",
        port=5,
        pages=wire.encode_pages([7, 8, 9]),
        aux_index=0,
        required_dst_info_num=1,
        window_pages=wire.encode_pages([4, 5]),
        nonce=2**40,
        state_row=6,
    )
    got = wire.decode(wire.encode(dst))
    assert got == dst and wire.decode_pages(got.window_pages).tolist() == [4, 5]
    assert got.nonce == 2**40 and got.state_row == 6
    done = wire.Done(room=2**62, prefill_rank=0, epoch="e", bytes=3 << 20, pages=9, nonce=3)
    assert wire.decode_payload(wire.encode_payload(done)) == done
    # a Done from a sender without the byte or page count still decodes (metrics count
    # 0 bytes, the decode unpacks every page)
    old = msgspec.msgpack.encode({"type": "done", "room": 7, "prefill_rank": 1, "epoch": "e"})
    assert wire.decode_payload(old) == wire.Done(
        room=7, prefill_rank=1, epoch="e", bytes=0, pages=-1, nonce=None
    )
    with pytest.raises(WireError, match="same kvbridge version"):
        wire.decode([b"KVBRIDGE/999", wire.encode_payload(done)])
    with pytest.raises(WireError):
        wire.decode([b"ABORT", b"1"])
    with pytest.raises(WireError):
        wire.decode_payload(b"\x93garbage")
    with pytest.raises(WireError):
        wire.decode_pages(b"\x01\x02\x03")


def test_messages_with_a_secret_are_authenticated_and_others_refused_keeping_what_they_said() -> (
    None
):
    a, b = b"prefill-and-decode", b"another"
    at, elsewhere = "tcp://10.0.0.1:5000", "tcp://10.0.0.2:5000"
    dst = wire.Destination(
        room=2**62 + 5,
        agent="d",
        ip="127.0.0.1",
        port=5,
        pages=wire.encode_pages([3, 4]),
        aux_index=1,
        required_dst_info_num=1,
    )
    frames = wire.sign(wire.encode(dst), a, at)
    assert len(frames) == 4 and wire.decode(wire.unsign(frames, a, at, ReplayGuard())) == dst
    tampered = [frames[0], wire.encode(msgspec.structs.replace(dst, room=1))[1], *frames[2:]]
    refusals = {
        "other secret": (frames, b, at),
        "no MAC": (wire.encode(dst), a, at),
        "tampered": (tampered, a, at),
        "for another receiver": (frames, a, elsewhere),
    }
    for what, (got, secret, receiver) in refusals.items():
        with pytest.raises(wire.AuthenticationError, match=r"no MAC|another secret") as info:
            wire.unsign(got, secret, receiver, ReplayGuard())
        assert "set the same 'secret'" in str(info.value), what
        # for the refusal, untrusted
        assert isinstance(info.value.unverified, wire.Destination), what
    with pytest.raises(wire.AuthenticationError, match="no 'secret'") as info:
        wire.decode(frames)  # a MAC but no secret here
    assert isinstance(info.value.unverified, wire.Destination)
    # bound to freshness: a captured message is refused again, and later
    guard = ReplayGuard()
    assert wire.unsign(frames, a, at, guard) == wire.encode(dst)
    with pytest.raises(wire.AuthenticationError, match="replayed") as info:
        wire.unsign(frames, a, at, guard)
    assert info.value.unverified is None, "a replay is not even read for what it says"
    old = wire.sign(wire.encode(dst), a, at, when=stamp(time.time() - 2 * FRESH_S))
    with pytest.raises(wire.AuthenticationError, match="stamped more than"):
        wire.unsign(old, a, at, ReplayGuard())
    # SGLang's own frames (an abort) are signed the same way
    abort = [b"ABORT", b"7", b"127.0.0.1", b"5"]
    assert wire.unsign(wire.sign(abort, a, at), a, at, ReplayGuard()) == abort
    with pytest.raises(wire.AuthenticationError):
        wire.unsign(abort, a, at, ReplayGuard())
    assert issubclass(wire.AuthenticationError, WireError)  # control loops log and go on
    # Done notifications: a stamp and the MAC follow the payload, bound to both agents
    done = wire.Done(room=7, prefill_rank=1, epoch="e", bytes=10)
    payload = wire.encode_payload(done, a, sender="p", receiver="d")
    notes = ReplayGuard()
    assert wire.decode_payload(payload, a, sender="p", receiver="d", guard=notes) == done
    with pytest.raises(wire.AuthenticationError, match="replayed"):
        wire.decode_payload(payload, a, sender="p", receiver="d", guard=notes)
    for secret, sender, receiver in ((b, "p", "d"), (a, "q", "d"), (a, "p", "e")):
        with pytest.raises(wire.AuthenticationError) as info:
            wire.decode_payload(payload, secret, sender=sender, receiver=receiver)
        assert info.value.unverified == done
    with pytest.raises(wire.AuthenticationError):
        wire.decode_payload(wire.encode_payload(done), a)  # unauthenticated
    with pytest.raises(WireError, match="malformed"):
        wire.decode_payload(payload)  # a MAC this side cannot check is not a message


def test_config_from_env(tmp_path) -> None:
    assert config_from_env({}).transport == "nixl"
    assert config_from_env({CONFIG_ENV: '{"transport": "mooncake"}'}).transport == "mooncake"
    path = tmp_path / "kvb.json"
    path.write_text(json.dumps({"transport": "mooncake", "timeouts": {"transfer_s": 5}}))
    cfg = config_from_env({CONFIG_ENV: f"@{path}"})
    assert (cfg.transport, cfg.timeouts.transfer_s) == ("mooncake", 5.0)
    with pytest.raises(ConfigError, match=r"KVBRIDGE_CONFIG.*transprot"):
        config_from_env({CONFIG_ENV: '{"transprot": "nixl"}'})
    with pytest.raises(ConfigError, match="cannot read"):
        config_from_env({CONFIG_ENV: f"@{tmp_path / 'missing.json'}"})
    assert (
        config_from_env({CONFIG_ENV: '{"wire_dtype": "fp8", "staging_mb": 64}'}).wire_dtype == "fp8"
    )


def test_transfer_pages_divide_the_server_s_pages() -> None:
    cfg = config_from_env({CONFIG_ENV: '{"transfer_block_size": 16}'})
    assert transfer_page_size(config_from_env({}), 32) == 32
    assert transfer_page_size(cfg, 16) == 16
    # either side's larger pages, as several transfer pages
    assert transfer_page_size(cfg, 64) == 16
    with pytest.raises(ConfigError, match="transfer_block_size 16 must divide") as err:
        transfer_page_size(cfg, 24)
    assert err.value.key == "transfer_block_size" and "--page-size" in str(err.value)


def test_a_decode_addresses_each_of_its_pages_as_several_transfer_pages() -> None:
    assert transfer_pages([3, 1], 4).tolist() == [12, 13, 14, 15, 4, 5, 6, 7]
    assert transfer_pages(np.array([3, 1], dtype=np.int32), 1).tolist() == [3, 1]
    # the same memory as the geometry in transfer pages: page 1's second half is transfer page 3
    _, _, ptrs, lens, item = sglang_pool(2)
    pages = kv_geometry(page_size=PAGE, ptrs=ptrs, lens=lens, item_lens=item)
    halves = pages.in_blocks_of(PAGE // 2)
    assert (
        halves.slot_address(halves.slot(0, 1, int(transfer_pages([1], 2)[1])))
        == pages.slot_address(pages.slot(0, 1, 1)) + pages.spec.block_bytes // 2
    )


def _window_positions(n: int, hit: int, window: int, page: int, unit: int) -> tuple[list, int]:
    """One side of SGLang's sliding-window transfer, position by position: the first
    position of each transfer page of its window page list (SGLang's rule on both
    sides: from ``max(hit, n - window)`` rounded down to this side's page, to the end of
    the page holding position ``n - 1``), and the end of its full-attention page list in
    transfer pages counted from the hit."""
    start = max(hit, n - window) // page * page
    end = -(-n // page) * page
    return list(range(start, end, unit)), (end - hit) // unit


@given(
    n=st.integers(1, 600),
    hit_pages=st.integers(0, 8),
    window=st.integers(1, 200),
    unit=st.sampled_from([1, 4, 16]),
    ratios=st.tuples(st.sampled_from([1, 2, 4]), st.sampled_from([1, 2, 4])),
)
@settings(max_examples=300, deadline=None)
def test_window_pages_pair_by_position_between_page_sizes(
    n: int, hit_pages: int, window: int, unit: int, ratios: tuple[int, int]
) -> None:
    """``transfer_block_size`` with a sliding-window pool: every pair ``window_overlap``
    makes is one position on both sides, and the pairs cover the window the decode
    reads (``[n - window, n)``) whole."""
    p_page, d_page = unit * ratios[0], unit * ratios[1]
    hit = hit_pages * max(p_page, d_page)
    if hit >= n:
        return
    src, src_end = _window_positions(n, hit, window, p_page, unit)
    dst, dst_end = _window_positions(n, hit, window, d_page, unit)
    s, d = window_overlap(len(src), src_end, len(dst), dst_end)
    assert src[s] == dst[d], "the pairs are the same positions on both sides"
    assert len(src[s]) == min(len(src), len(dst)), "the smaller pages' list is paired whole"
    covered = {pos for first in src[s] for pos in range(first, first + unit)}
    assert covered >= set(range(max(hit, n - window), n)), "the window the decode reads"


def test_a_decode_with_other_pages_is_refused_naming_transfer_block_size() -> None:
    mine = CacheSpec(
        num_layers=2, block_size=16, num_kv_heads=1, head_dim=256, dtype="uint8", layout="nhd"
    )
    err = pages_differ(msgspec.structs.replace(mine, block_size=32), mine)
    assert "set transfer_block_size 16" in str(err)
    assert "set transfer_block_size 8" in str(
        pages_differ(msgspec.structs.replace(mine, block_size=8), mine)
    ), "the smaller of the two"
    assert "transfer_block_size" not in str(
        pages_differ(msgspec.structs.replace(mine, head_dim=128), mine)
    )


def test_importing_the_adapter_imports_no_sglang() -> None:
    import subprocess
    import sys

    code = (
        "import sys, kvbridge.adapters.sglang, kvbridge.wire.room_messages; print('sglang' "
        "in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert out == "False"


# --- restart and abort bookkeeping (lifecycle.py) -----------------------------------------


def _epoch(instance: str, ranks: dict[str, str] | None = None, ready: bool = True) -> InstanceEpoch:
    return InstanceEpoch(instance=instance, ranks=ranks or {}, ready=ready)


def test_watcher_sees_a_restart_as_a_new_instance_and_forgets_it() -> None:
    w = EpochWatcher()
    w.remember("p:1", _epoch("a", {"dp0/cp0/tp0/pp0": "x"}))
    assert w.observe("p:1", _epoch("a", {"dp0/cp0/tp0/pp0": "x"})) is Verdict.SAME
    # same bootstrap server, a rank re-registered with another epoch: also a new instance
    assert w.observe("p:1", _epoch("a", {"dp0/cp0/tp0/pp0": "y"})) is Verdict.RESTARTED
    assert w.known("p:1") is None
    # the next answer is recorded as the new instance
    assert w.observe("p:1", _epoch("b", {"dp0/cp0/tp0/pp0": "z"})) is Verdict.FIRST
    assert w.observe("p:1", _epoch("b", {"dp0/cp0/tp0/pp0": "z"})) is Verdict.SAME
    assert w.observe("p:1", _epoch("c")) is Verdict.RESTARTED


def test_watcher_does_not_record_a_half_registered_instance() -> None:
    w = EpochWatcher()
    assert w.observe("p:1", _epoch("a", {"dp0/cp0/tp0/pp0": "x"}, ready=False)) is Verdict.FIRST
    assert w.known("p:1") is None
    full = _epoch("a", {"dp0/cp0/tp0/pp0": "x", "dp0/cp0/tp1/pp0": "y"})
    assert w.observe("p:1", full) is Verdict.FIRST
    assert w.observe("p:1", full) is Verdict.SAME
    # a restarting instance that is not ready yet is still another instance
    assert w.observe("p:1", _epoch("b", ready=False)) is Verdict.RESTARTED


def test_watcher_declares_down_only_after_consecutive_refusals() -> None:
    w = EpochWatcher(refusals_for_down=2)
    w.remember("p:1", _epoch("a"))
    assert w.observe("p:1", None) is Verdict.UNANSWERED  # timed out: busy, not dead
    assert w.observe("p:1", None, refused=True) is Verdict.UNANSWERED
    assert w.observe("p:1", _epoch("a")) is Verdict.SAME  # an answer resets the count
    assert w.observe("p:1", None, refused=True) is Verdict.UNANSWERED
    assert w.observe("p:1", None, refused=True) is Verdict.DOWN
    assert w.known("p:1") is None and w.addresses() == set()


def test_epoch_document_round_trips_and_refuses_garbage() -> None:
    doc = _epoch("a", {rank_key(dp=0, cp=0, tp=1, pp=0): "x"})
    assert decode_epoch(encode_epoch(doc)) == doc
    assert decode_epoch(encode_epoch(doc)).ranks == {"dp0/cp0/tp1/pp0": "x"}
    for bad in (b"not json", b'{"ranks": {}}', b'{"instance": 3}', b"[]"):
        with pytest.raises(WireError):
            decode_epoch(bad)


def test_tombstones_remember_recent_aborts_only() -> None:
    t = Tombstones(capacity=3)
    for room in (1, 2, 3):
        t.add(room, f"aborted {room}")
    assert t.reason(2) == "aborted 2"
    t.add(1, "again")  # refreshed: now the newest
    t.add(4, "aborted 4")  # evicts the oldest, 2
    assert t.reason(2) is None
    assert [t.reason(r) for r in (1, 3, 4)] == ["again", "aborted 3", "aborted 4"]
    assert len(t) == 3


def test_prometheus_export_accumulates_snapshots_under_sglang_names() -> None:
    registry = CollectorRegistry()
    labels = {"engine_type": "prefill", "tp_rank": "0", "transport": "mooncake"}
    export = PrometheusExport(labels, registry=registry)
    export.export(
        StatsSnapshot(bytes_sent=4096, transfers=2, exposed_s=[0.003], request_transfer_s=[0.2])
    )
    export.export(StatsSnapshot(bytes_sent=1024, requests_sent=1, failures=1))

    def value(name: str, **extra: str) -> float | None:
        return registry.get_sample_value(name, {**labels, **extra})

    assert value("sglang:kvbridge_bytes_sent_total") == 5120
    assert value("sglang:kvbridge_transfers_total") == 2
    assert value("sglang:kvbridge_requests_sent_total") == 1
    assert value("sglang:kvbridge_failures_total") == 1
    assert value("sglang:kvbridge_bytes_received_total") == 0
    assert value("sglang:kvbridge_exposed_transfer_seconds_count") == 1
    assert value("sglang:kvbridge_exposed_transfer_seconds_bucket", le="0.0025") == 0
    assert value("sglang:kvbridge_exposed_transfer_seconds_bucket", le="0.005") == 1
    assert value("sglang:kvbridge_request_transfer_seconds_sum") == pytest.approx(0.2)


def test_prometheus_export_counts_a_requests_writes_before_the_request() -> None:
    """The per-path write counters: a reader that sees a request sent sees its writes
    (the integration tests read which path a room took this way)."""
    registry = CollectorRegistry()
    labels = {"engine_type": "prefill", "tp_rank": "1", "transport": "nixl"}
    export = PrometheusExport(labels, registry=registry)
    seen: list[tuple[str, float]] = []
    for name, counter in export._counters.items():
        counter.inc = lambda value, name=name, inc=counter.inc: (
            seen.append((name, value)),
            inc(value),
        )
    export.export(StatsSnapshot(layer_writes=24, chunk_writes=2, requests_sent=1))
    assert [name for name, _ in seen] == ["layer_writes", "chunk_writes", "requests_sent"]
    assert registry.get_sample_value("sglang:kvbridge_layer_writes_total", labels) == 24
    assert registry.get_sample_value("sglang:kvbridge_chunk_writes_total", labels) == 2


def test_prometheus_export_sets_staging_levels() -> None:
    registry = CollectorRegistry()
    labels = {"engine_type": "decode", "tp_rank": "1", "transport": "nixl"}
    export = PrometheusExport(labels, registry=registry)
    export.set_levels(staging_slots=512, staging_slots_used=40)
    export.set_levels(staging_slots_used=0)
    assert registry.get_sample_value("sglang:kvbridge_staging_slots", labels) == 512
    assert registry.get_sample_value("sglang:kvbridge_staging_slots_used", labels) == 0


def test_no_export_without_sglang_metrics(monkeypatch) -> None:
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    assert exporter(role="decode", tp_rank=0, transport="nixl") is None


# --- lanes: the samples of a request with n > 1 on one bootstrap room ------------------


def test_each_endpoint_of_a_room_gets_its_lane_and_both_servers_agree() -> None:
    """The k-th endpoint made for a room works under ``lane_room(room, k)``, the first
    under the room itself; a prefill and a decode that see the room's requests in the
    same order (primer, then samples) pair lane for lane. Lane rooms stay distinct,
    below 2**63 and keep the room's residue modulo every data-parallel size up to 16."""
    for room in (12345, (1 << 63) - 3):  # the second: lane ids count down from the top
        prefill, decode = RoomLanes(), RoomLanes()
        lanes = [prefill.take(room) for _ in range(9)]  # a primer and 8 samples
        assert lanes == [decode.take(room) for _ in range(9)]
        assert lanes[0] == room and lanes == [lane_room(room, k) for k in range(9)]
        assert len(set(lanes)) == 9 and all(0 <= r < 1 << 63 for r in lanes)
        for dp in range(1, 17):
            assert {r % dp for r in lanes} == {room % dp}, dp
    assert RoomLanes().take(None) is None  # no room (SGLang's fake transfers)


def test_lanes_are_kept_for_the_recent_rooms_only() -> None:
    lanes = RoomLanes(capacity=2)
    assert [lanes.take(r) for r in (1, 2, 1)] == [1, 2, lane_room(1, 1)]
    lanes.take(3)  # room 2, the least recently used, is forgotten
    assert lanes.take(1) == lane_room(1, 2) and lanes.take(2) == 2


# --- data parallelism: which DP rank a prefill replica is; which seat a rank holds ------


def _manager(**ranks) -> SimpleNamespace:
    base = {"system_dp_size": 1, "system_dp_rank": 0, "attn_dp_size": 1, "attn_dp_rank": 0}
    return SimpleNamespace(**{**base, **ranks})


def test_a_dp_replica_names_its_replica_as_its_dp_rank_and_dp_attention_keeps_its_own() -> None:
    """SGLang's sender checks (or registers) ``kv_mgr.attn_dp_rank`` as the request's
    prefill DP rank, which SGLang's bootstrap server and decode count as the replica
    (``system_dp_rank``) when there are replicas (``--dp-size``)."""
    replica = _manager(system_dp_size=2, system_dp_rank=1)
    compat.serve_replica_dp_rank(replica)
    assert replica.attn_dp_rank == 1 and replica.system_dp_rank == 1
    attention = _manager(attn_dp_size=2, attn_dp_rank=1)
    compat.serve_replica_dp_rank(attention)
    assert attention.attn_dp_rank == 1
    plain = _manager()
    compat.serve_replica_dp_rank(plain)
    assert plain.attn_dp_rank == 0


def test_a_seat_tells_the_ranks_of_servers_and_replicas_apart_and_survives_a_restart() -> None:
    def seat(port: int, tp: int = 0, **ranks) -> str:
        mgr = SimpleNamespace(
            **vars(_manager(**ranks)), local_ip="10.0.0.7", attn_tp_rank=tp, pp_rank=0
        )
        return compat.server_seat(SimpleNamespace(port=port), mgr)

    first = seat(30000)
    assert first == seat(30000), "a restart on the same address keeps its seat"
    others = [
        seat(30001),
        seat(30000, tp=1),
        seat(30000, system_dp_rank=1),
        seat(30000, attn_dp_rank=1),
    ]
    assert len({first, *others}) == 5, others
    assert "10.0.0.7:30000" in first


def test_a_registration_without_a_seat_comes_from_an_older_decode_and_replaces_nothing() -> None:
    _, _, ptrs, lens, item = sglang_pool(2)
    reg = wire.Registration(
        agent="sglang-decode-r0-abc",
        epoch="abc",
        transport="nixl",
        transport_md=b"",
        geometry=kv_geometry(page_size=PAGE, ptrs=ptrs, lens=lens, item_lens=item),
        aux=RowLayout(ptrs=(1,), item_lens=(64,), rows=3),
        ip="127.0.0.1",
        port=5555,
    )
    seated = msgspec.structs.replace(reg, seat="127.0.0.1:30000 dp1.0 tp0 pp0")
    assert wire.decode(wire.encode(seated)) == seated
    assert wire.decode(wire.encode(reg)).seat == ""


def test_dp_ranks_not_assigned_by_room_are_warned_about_for_parallel_sampling(caplog) -> None:
    caplog.set_level("WARNING", logger="kvbridge.adapters.sglang.compat")
    compat.warn_unless_balanced_by_room(_manager(system_dp_size=2), "round_robin")
    compat.warn_unless_balanced_by_room(_manager(attn_dp_size=4), "total_tokens")
    compat.warn_unless_balanced_by_room(_manager(system_dp_size=2), "follow_bootstrap_room")
    compat.warn_unless_balanced_by_room(_manager(), "round_robin")  # one DP rank: nothing to pair
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 2, warned
    assert "2 DP ranks are balanced by round_robin" in warned[0]
    assert "4 DP ranks are balanced by total_tokens" in warned[1]
    assert all("--load-balance-method follow_bootstrap_room" in m for m in warned)
