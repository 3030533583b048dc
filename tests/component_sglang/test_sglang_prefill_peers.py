"""The SGLang prefill's bookkeeping of decode peers and failed rooms, on its own methods
(no servers). Runs in .venv-sglang (``prefill`` imports SGLang's classes).

- It adds a decode's registration on its control thread, which also takes every room's
  destination: adding the peer must not wait on that decode (a real Mooncake transport,
  the backend whose ``add_peer`` can wait on the peer, and a decode process that cannot
  answer: SIGSTOPped).
- Decode ranks are told apart by seat (other servers, DP replicas), a restarted rank
  replaces its old agent, and no registration takes another's agent (a recording
  stand-in transport).
- A room SGLang failed before its destination came is answered with the failure.
The servers' behaviour is in ``test_sglang_dp.py``."""

from __future__ import annotations

import time
from collections import Counter
from types import SimpleNamespace

import msgspec
import pytest

try:
    from kvbridge.adapters.sglang import compat
    from kvbridge.adapters.sglang.admission import Admission
    from kvbridge.adapters.sglang.prefill import KVPoll, PrefillSide
    from kvbridge.adapters.sglang.registrations import PrefillRank, Registrations
    from kvbridge.wire import room_messages as wire
except ImportError as exc:  # pragma: no cover
    raise RuntimeError(
        "tests/integration_sglang needs .venv-sglang: bash scripts/setup-sglang.sh"
    ) from exc

from kvbridge.adapters.sglang.lifecycle import Tombstones
from kvbridge.core.layout import CacheGeometry, CacheSpec
from kvbridge.core.rows import RowLayout
from kvbridge.errors import IncompatiblePeerError
from kvbridge.transports.testing import Local, Peer, unique
from kvbridge.wire.peer_compat import CompatInfo

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
    aux = RowLayout(ptrs=(decode.base + planes * 8 * spec.block_bytes,), item_lens=(64,), rows=3)
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
        prefill = _registrations(ours.t, reg.aux, lambda **fields: None)
        try:
            with decode.paused():
                start = time.monotonic()
                prefill.register(reg)
                took = time.monotonic() - start
            assert took < 2, (
                f"registering a stopped decode held the prefill's control thread {took:.1f}s"
            )
            assert decode.agent_name in prefill.peers, (
                "the decode is registered; a dead one shows at its first write"
            )
        finally:
            ours.close()


class _Transport:
    """What registering a decode and the peer table ask of a transport, recorded."""

    def __init__(self) -> None:
        self.removed: list[str] = []

    def peer_name(self, metadata: bytes) -> str:
        return metadata.decode()

    def add_peer(self, metadata: bytes, probe: bool = True) -> str:
        return metadata.decode()

    def prepare(self, table, memory: str, peer: str | None = None) -> tuple:
        return ("table", peer)

    def release_table(self, table) -> None:
        pass

    def remove_peer(self, agent: str) -> None:
        self.removed.append(agent)


def _registrations(transport, aux: RowLayout, count) -> Registrations:
    """A prefill rank's registrations whose checks all pass (these tests are about
    what is kept, not what is refused)."""
    rank = PrefillRank(
        transport="mooncake",
        wire_dtype="exact",
        data_path="direct",
        compat=None,
        page_size=16,
        geometry=None,
        aux_layout=aux,
    )
    registrations = Registrations(rank, transport, count, lambda *a: None)
    registrations.pairing = lambda reg: None
    registrations.state_cut = lambda reg: None
    return registrations


def test_decode_ranks_of_other_servers_stay_peers_and_a_restarted_rank_replaces_its_agent() -> None:
    """Every decode server's first rank has an agent named ``sglang-decode-r0-<epoch>``
    (with DP replicas, every replica's too): the prefill tells them apart by seat."""
    transport = _Transport()
    base = _registration(SimpleNamespace(agent_name="x", base=4096, metadata=b""))
    counted: Counter[str] = Counter()  # the metrics' counters, by StatsSnapshot field
    prefill = _registrations(transport, base.aux, counted.update)

    def register(agent: str, seat: str) -> None:
        prefill.register(
            msgspec.structs.replace(base, agent=agent, transport_md=agent.encode(), seat=seat)
        )

    register("sglang-decode-r0-aaa", "10.0.0.1:30001 dp0.0 tp0 pp0")
    register("sglang-decode-r0-bbb", "10.0.0.1:30002 dp0.0 tp0 pp0")  # another server
    register("sglang-decode-r0-ccc", "10.0.0.1:30001 dp1.0 tp0 pp0")  # another DP replica
    assert set(prefill.peers) == {
        "sglang-decode-r0-aaa",
        "sglang-decode-r0-bbb",
        "sglang-decode-r0-ccc",
    }
    assert transport.removed == []
    register("sglang-decode-r0-ddd", "10.0.0.1:30001 dp0.0 tp0 pp0")  # the first, restarted
    assert set(prefill.peers) == {
        "sglang-decode-r0-bbb",
        "sglang-decode-r0-ccc",
        "sglang-decode-r0-ddd",
    }
    assert transport.removed == ["sglang-decode-r0-aaa"]
    register("sglang-decode-r0-eee", "")  # an older decode, without a seat: replaces nothing
    assert len(prefill.peers) == 4 and transport.removed == ["sglang-decode-r0-aaa"]
    register("sglang-decode-r0-eee", "")  # registered already: nothing new
    assert (counted["peers_registered"], counted["peers_replaced"]) == (5, 1)


def test_a_registration_with_another_agent_s_transport_metadata_is_refused() -> None:
    """Adding it would have replaced the victim's transport peer (its tables released)
    and kept the stranger under the victim's agent."""
    transport = _Transport()
    base = _registration(SimpleNamespace(agent_name="x", base=4096, metadata=b""))
    prefill = _registrations(transport, base.aux, lambda **fields: None)
    victim = msgspec.structs.replace(base, agent="victim", transport_md=b"victim", seat="a")
    prefill.register(victim)
    prefill.register(msgspec.structs.replace(victim, agent="stranger", seat="b"))
    assert set(prefill.peers) == {"victim"} and transport.removed == []
    assert "metadata of agent 'victim'" in prefill.refused["stranger"]
    # under the kept agent's own name: nothing recorded that would fail its rooms
    prefill.register(msgspec.structs.replace(victim, transport_md=b"stranger", seat="b"))
    assert set(prefill.peers) == {"victim"} and "victim" not in prefill.refused


class _SGLangManager:
    """The part of SGLang's ``CommonKVManager`` a failure touches."""

    def __init__(self) -> None:
        self.failure_records: dict[int, str] = {}

    def record_failure(self, bootstrap_room: int, failure_reason: str) -> None:
        self.failure_records[bootstrap_room] = failure_reason


class _Prefill(PrefillSide, _SGLangManager):
    pass


def test_a_destination_for_a_room_sglang_failed_before_it_came_is_answered_with_the_failure() -> (
    None
):
    """SGLang fails some rooms on the prefill without telling the decode (its bootstrap
    timeout, a DP rank that does not match the room): a destination that comes for such
    a room later is answered with SGLang's reason at once, not stored to wait for KV."""
    prefill = _Prefill()
    prefill.tombstones = Tombstones()
    sent: list[dict] = []
    prefill.transfer_infos = {}
    admission = Admission(
        registrations=SimpleNamespace(peers={}, refused={}),
        destinations=compat.RoomDestinations(prefill),
        room_status=compat.RoomStatus(prefill),
        tombstones=prefill.tombstones,
        holder=lambda room: None,
        send_status=lambda **kw: sent.append(kw),
        count=lambda **fields: None,
        epoch="e",
        packed=False,
        states=False,
        lease_s=60.0,
    )
    reason = "Request 7 timed out after 15.0s in KVPoll.Bootstrapping"
    prefill.record_failure(7, reason)
    assert prefill.failure_records == {7: reason}, "SGLang's own record is kept"
    dest = wire.Destination(
        room=7,
        agent="sglang-decode-r0-aaa",
        ip="127.0.0.1",
        port=5,
        pages=wire.encode_pages([1, 2]),
        aux_index=0,
        required_dst_info_num=1,
    )
    admission.destination(dest)
    assert sent == [
        {
            "targets": [("127.0.0.1", 5)],
            "bootstrap_room": 7,
            "status": KVPoll.Failed,
            "failure_reason": reason,
        }
    ]
    assert prefill.transfer_infos == {}, "nothing waits for the room"
    decode_side = _Prefill()  # a decode's manager keeps no tombstones
    decode_side.record_failure(8, "x")
    assert decode_side.tombstones is None and decode_side.failure_records == {8: "x"}


def test_a_decode_with_other_settings_is_refused_naming_each_and_the_fix() -> None:
    """The settings both sides must share (transport, wire_dtype, data_path) are checked
    as the vLLM handshake checks them (``wire.peer_compat.settings_mismatch``): one error
    naming every difference, and the fix apart from the message."""
    from kvbridge.config import load_config
    from kvbridge.errors import IncompatiblePeerError

    base = _registration(SimpleNamespace(agent_name="d0", base=4096, metadata=b""))
    reg = msgspec.structs.replace(base, transport="mooncake", data_path="packed")
    config = load_config({"transport": "nixl"})
    prefill = Registrations(
        PrefillRank(
            transport=config.transport,
            wire_dtype=config.wire_dtype,
            data_path=config.resolved_data_path,
            compat=None,
            page_size=16,
            geometry=None,
            aux_layout=None,
        ),
        None,
        lambda **fields: None,
        lambda *a: None,
    )
    with pytest.raises(IncompatiblePeerError) as info:  # before the compatibility info
        prefill.pairing(reg)
    assert info.value.differences == {
        "transport": ("nixl", "mooncake"),
        "data_path": ("direct", "packed"),
    }
    assert info.value.fix is not None and "'transport', 'data_path'" in info.value.fix
    assert "decode d0 uses transport 'mooncake', data_path 'packed'" in str(info.value)


COMPAT = CompatInfo(
    model="/models/tiny-llama", dtype="float16", layout="nhd", block_size=16, num_layers=2,
    num_kv_heads=2, head_dim=64, tp_size=2, total_kv_heads=4,
)  # fmt: skip


def _checked(reg: wire.Registration, secret: bytes | None = None) -> IncompatiblePeerError | None:
    """What a prefill with :data:`COMPAT` (attention TP 2) says of ``reg``'s info."""
    rank = PrefillRank(
        transport="mooncake",
        wire_dtype="exact",
        data_path="direct",
        compat=COMPAT,
        disclose=secret is not None,
        page_size=16,
        geometry=None,
        aux_layout=None,
    )
    try:
        Registrations(rank, None, lambda **fields: None, lambda *a: None).check_compat(reg)
    except IncompatiblePeerError as exc:
        return exc
    return None


def test_a_decode_of_another_model_or_cache_is_refused_by_its_compatibility_hash() -> None:
    """As a vLLM prefill checks a Hello: the hash of what both sides must share first
    (the model too, which no typed field of a registration names: a decode of another
    model with the same cache shape was served before), one error naming each
    difference and the fix. Without a secret the text, which travels to the decode as
    its rooms' failure reason, carries the decode's values only."""
    base = _registration(SimpleNamespace(agent_name="d0", base=4096, metadata=b""))
    other = msgspec.structs.replace(COMPAT, model="/models/other", block_size=32)
    err = _checked(msgspec.structs.replace(base, compat=other))
    assert err is not None and set(err.differences) == {"model", "block_size"}
    text = str(err)
    assert "decode d0's KV cache is incompatible with this prefill's" in text
    assert "model: prefill's differs, decode='/models/other'" in text
    assert "tiny-llama" not in text, "the prefill's model is not told to an unauthenticated peer"
    assert err.fix is not None and "identical model, block_size" in err.fix
    assert "transfer_block_size" in err.fix
    told = _checked(msgspec.structs.replace(base, compat=other), secret=b"s")
    assert "model: prefill='/models/tiny-llama', decode='/models/other'" in str(told)


def test_a_decode_of_another_tp_size_passes_the_hash_and_one_without_info_is_refused() -> None:
    base = _registration(SimpleNamespace(agent_name="d0", base=4096, metadata=b""))
    tp1 = msgspec.structs.replace(COMPAT, num_kv_heads=4, tp_size=1)
    assert _checked(msgspec.structs.replace(base, compat=tp1)) is None, (
        "the TP split is checked by the pairing, not the hash"
    )
    assert _checked(msgspec.structs.replace(base, compat=COMPAT)) is None
    heads = msgspec.structs.replace(COMPAT, total_kv_heads=8)
    assert set(_checked(msgspec.structs.replace(base, compat=heads)).differences) == {
        "model_kv_heads"
    }
    err = _checked(base)  # a decode of an earlier kvbridge
    assert err is not None and "sent no compatibility info" in str(err)
    assert err.fix is not None and "same kvbridge version" in err.fix
