from __future__ import annotations

import msgspec
import pytest

from kvbridge.core.layout import CacheGeometry, CacheSpec
from kvbridge.errors import IncompatiblePeerError, ProtocolVersionError, WireError
from kvbridge.wire import messages as m
from kvbridge.wire.codec import MAX_FRAME_BYTES, Codec
from kvbridge.wire.peer_compat import PROTOCOL_VERSION, CompatInfo, compat_diff, compat_hash

SPEC = CacheSpec(
    num_layers=2, block_size=32, num_kv_heads=2, head_dim=64, dtype="float32", layout="fused"
)
GEO = CacheGeometry(spec=SPEC, num_blocks=10, plane_bases=(1 << 20, 1 << 21))
INFO = CompatInfo.from_spec(SPEC, model="tiny-llama")
PEER = m.PeerId(engine_id="prefill-0", epoch="5f3a", rank=0)

ALL_MESSAGES = [
    m.Hello(peer=PEER, compat=INFO, transport="nixl", transport_metadata=b"\x00\x01", geometry=GEO),
    m.Welcome(
        peer=PEER,
        compat=INFO,
        transport="mooncake",
        transport_metadata=b"127.0.0.1:1",
        geometry=GEO,
    ),
    m.Destination(transfer_id="r1", peer=PEER, block_ids=[3, 4, 5], num_tokens=90, skip_tokens=32),
    m.Destination(
        transfer_id="r2",
        peer=PEER,
        block_ids=[3, 4, 5],
        num_tokens=96,
        group_block_ids=[[-1, 8, 9]],
    ),
    m.Release(transfer_id="r1", peer=PEER, ok=False, reason="read failed"),
    m.LayerDone(transfer_id="r1", layers=[0, 1], first_block=2, num_blocks=3),
    m.Done(transfer_id="r1", ok=False, reason="lease expired"),
    m.Done(transfer_id="r1", ok=False, reason="the prefill request ended", aborted=True),
    m.Abort(transfer_id="r1", peer=PEER, reason="client gone"),
    m.Heartbeat(peer=PEER),
    m.Reply(ok=False, code="unknown_peer", detail="say Hello", epoch="e2"),
]


@pytest.mark.parametrize("msg", ALL_MESSAGES, ids=lambda x: type(x).__name__)
def test_every_message_round_trips(msg: m.Message) -> None:
    codec = Codec(INFO)
    out = codec.decode(codec.encode(msg))
    assert out == msg and type(out) is type(msg)


def test_frame_layout_is_version_hash_body() -> None:
    frame = msgspec.msgpack.decode(Codec(INFO).encode(m.Done(transfer_id="x")))
    assert frame[0] == PROTOCOL_VERSION and frame[1] == compat_hash(INFO)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(frame[2])) == {
        "t": "done",
        "transfer_id": "x",
        "ok": True,
        "reason": "",
        "source": 0,
        "aborted": False,
    }


def test_compat_hash_is_checked_before_the_body() -> None:
    theirs = msgspec.structs.replace(INFO, dtype="bfloat16", block_size=16)
    hello = m.Hello(
        peer=PEER, compat=theirs, transport="nixl", transport_metadata=b"", geometry=GEO
    )
    with pytest.raises(IncompatiblePeerError) as info:
        Codec(INFO).decode(Codec(theirs).encode(hello))
    assert info.value.differences == {"dtype": ("float32", "bfloat16"), "block_size": (32, 16)}
    assert "dtype: ours='float32', peer='bfloat16'" in str(info.value)
    assert "fix: start prefill and decode with identical dtype, block_size" in str(info.value)
    # a non-handshake frame only has the hash to go on, and its body is never decoded
    garbage_body = msgspec.msgpack.encode(
        [PROTOCOL_VERSION, compat_hash(theirs), b"\xc1 not msgpack"]
    )
    with pytest.raises(IncompatiblePeerError, match="compat hash"):
        Codec(INFO).decode(garbage_body)


def test_an_incompatible_hello_of_megabytes_gets_an_error_of_a_few_hundred_characters() -> None:
    """A peer's values are quoted in the error that is logged and answered to it: a
    3.8 MB model name used to make 11 MB of error text (issue 46, reproduction 5)."""
    theirs = msgspec.structs.replace(INFO, model="m" * 3_800_000)
    hello = m.Hello(
        peer=PEER, compat=theirs, transport="nixl", transport_metadata=b"", geometry=GEO
    )
    with pytest.raises(IncompatiblePeerError) as info:
        Codec(INFO).decode(Codec(theirs).encode(hello))
    text = str(info.value)
    assert len(text) < 600, f"{len(text)} characters"
    assert text.startswith("peer's KV cache is incompatible: model: ours='tiny-llama', peer='mmm")
    assert text.endswith("(fix: start prefill and decode with identical model)")


def test_protocol_version_mismatch() -> None:
    frame = msgspec.msgpack.encode(
        [PROTOCOL_VERSION + 1, compat_hash(INFO), {"t": "done", "transfer_id": "x"}]
    )
    with pytest.raises(ProtocolVersionError, match="same kvbridge version"):
        Codec(INFO).decode(frame)


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"", "undecodable"),
        (b"\xff\xfe garbage", "undecodable"),
        (msgspec.msgpack.encode({"v": 1}), "undecodable"),
        (msgspec.msgpack.encode([PROTOCOL_VERSION, compat_hash(INFO), {"t": "nope"}]), "malformed"),
        (
            msgspec.msgpack.encode(
                [PROTOCOL_VERSION, compat_hash(INFO), {"t": "dest", "transfer_id": "r"}]
            ),
            "malformed",
        ),
        (
            msgspec.msgpack.encode(
                [
                    PROTOCOL_VERSION,
                    compat_hash(INFO),
                    {
                        "t": "dest",
                        "transfer_id": "r",
                        "peer": {"engine_id": "e", "epoch": "1"},
                        "block_ids": "3",
                        "num_tokens": 1,
                    },
                ]
            ),
            "malformed",
        ),
    ],
)
def test_malformed_frames_raise_wire_error(data: bytes, match: str) -> None:
    with pytest.raises(WireError, match=match):
        Codec(INFO).decode(data)


def test_oversized_frame_is_refused_before_decoding() -> None:
    with pytest.raises(WireError, match="exceeds"):
        Codec(INFO).decode(b"\x00" * (MAX_FRAME_BYTES + 1))


def test_unknown_fields_from_newer_peers_are_tolerated() -> None:
    """Schema evolution: a newer peer may append fields; an older one ignores them."""
    body = {"t": "done", "transfer_id": "r", "reason": "x", "added_in_v1_1": [1, 2]}
    frame = msgspec.msgpack.encode([PROTOCOL_VERSION, compat_hash(INFO), body])
    assert Codec(INFO).decode(frame) == m.Done(transfer_id="r", reason="x")


def test_compat_hash_changes_with_every_property() -> None:
    base = compat_hash(INFO)
    changes = {
        "model": "other",
        "dtype": "bfloat16",
        "layout": "nhd",
        "block_size": 64,
        "num_layers": 3,
        "num_kv_heads": 4,
        "head_dim": 128,
        "tp_size": 3,
        "total_kv_heads": 16,
        "layer_groups": (0, 1),
        "group_windows": (0, 40),
    }
    hashes = {compat_hash(msgspec.structs.replace(INFO, **{k: v})) for k, v in changes.items()}
    assert base not in hashes and len(hashes) == len(changes)


def test_peers_without_kv_cache_groups_keep_the_hash_of_earlier_releases() -> None:
    """``layer_groups`` and ``group_windows`` came after the first release: a peer that
    sets neither hashes as before (the value kvbridge 0.1.0.dev0 computed for this info,
    before the fields existed), and groups make a peer differ, naming what."""
    info = CompatInfo(
        model="m",
        dtype="bfloat16",
        layout="nhd",
        block_size=16,
        num_layers=32,
        num_kv_heads=8,
        head_dim=128,
    )
    assert compat_hash(info) == "b50daa35b00660b4"
    hybrid = msgspec.structs.replace(info, layer_groups=(0, 1) * 16, group_windows=(0, 128))
    assert compat_hash(hybrid) != compat_hash(info)
    assert compat_diff(info, hybrid) == {
        "layer_groups": ((), (0, 1) * 16),
        "group_windows": ((), (0, 128)),
    }


def test_nhd_and_hnd_caches_are_compatible_on_the_packed_path_only() -> None:
    nhd, hnd = (msgspec.structs.replace(INFO, layout=layout) for layout in ("nhd", "hnd"))
    assert compat_hash(nhd) != compat_hash(hnd) and compat_diff(nhd, hnd) == {
        "layout": ("nhd", "hnd")
    }
    packed = [msgspec.structs.replace(info, data_path="packed") for info in (nhd, hnd)]
    assert compat_hash(packed[0]) == compat_hash(packed[1]) and compat_diff(*packed) == {}
    # the rows of a latent or a fused cache are another matter, packed or not
    for other in ("latent", "fused"):
        assert compat_hash(msgspec.structs.replace(packed[0], layout=other)) != compat_hash(
            packed[0]
        )


def test_compat_hash_ignores_the_tp_split_but_not_the_model_heads() -> None:
    """TP 1 with 2 KV heads per rank and TP 2 with 1 per rank hold the same model: their
    frames are compatible (the handshake pairs the ranks); a model with other heads is not."""
    tp1 = msgspec.structs.replace(INFO, num_kv_heads=2, tp_size=1)
    tp2 = msgspec.structs.replace(INFO, num_kv_heads=1, tp_size=2)
    assert compat_hash(tp1) == compat_hash(tp2)
    assert compat_hash(msgspec.structs.replace(tp2, num_kv_heads=2)) != compat_hash(tp1)
    # more ranks than heads: each rank holds one replicated head, the model still has 2
    tp4 = msgspec.structs.replace(INFO, num_kv_heads=1, tp_size=4, total_kv_heads=2)
    assert compat_hash(tp4) == compat_hash(tp1)
