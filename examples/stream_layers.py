"""Stream a KV cache layer by layer from a "prefill" process to a "decode" process.

What the engine integrations do, with numpy arrays standing in for the KV cache and a
multiprocessing pipe standing in for the side channel:

1. both sides register their cache with the transport and describe it (CacheGeometry);
2. handshake: Hello / Welcome frames (compatibility checked before anything else);
3. decode allocates blocks and sends a Destination;
4. prefill plans and posts one write per layer, each carrying a LayerDone notification,
   then sends Done;
5. decode verifies every block it received.

    python examples/stream_layers.py [nixl|mooncake]
"""

from __future__ import annotations

import multiprocessing as mp
import sys
import time
import uuid

import numpy as np

from kvbridge.config import load_config
from kvbridge.core.layout import CacheGeometry, CacheSpec
from kvbridge.core.plan import plan_blocks
from kvbridge.transports import create_transport
from kvbridge.wire.codec import Codec
from kvbridge.wire.messages import Destination, Done, Hello, LayerDone, PeerId, Welcome
from kvbridge.wire.peer_compat import CompatInfo

LAYERS, BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM = 4, 64, 32, 2, 64
SPEC = CacheSpec(
    num_layers=LAYERS,
    block_size=BLOCK_SIZE,
    num_kv_heads=HEADS,
    head_dim=HEAD_DIM,
    dtype="float32",
    layout="fused",
)
CODEC = Codec(CompatInfo.from_spec(SPEC, model="example-model"))


def make_cache(seed: int | None) -> tuple[np.ndarray, CacheGeometry]:
    """vLLM's CPU layout: per layer (num_blocks, heads, block_size, 2 * head_dim)."""
    shape = (LAYERS, BLOCKS, HEADS, BLOCK_SIZE, 2 * HEAD_DIM)
    cache = (
        np.random.default_rng(seed).standard_normal(shape, dtype=np.float32)
        if seed is not None
        else np.zeros(shape, np.float32)
    )
    geo = CacheGeometry(
        spec=SPEC,
        num_blocks=BLOCKS,
        plane_bases=tuple(cache[layer].ctypes.data for layer in range(LAYERS)),
    )
    return cache, geo


def hello(cls, me: PeerId, transport, geo: CacheGeometry):
    return cls(
        peer=me,
        compat=CODEC.compat,
        transport=transport.name,
        transport_metadata=transport.metadata(),
        geometry=geo,
    )


def prefill(conn, transport_name: str) -> None:
    me = PeerId(engine_id="prefill", epoch=uuid.uuid4().hex[:8])
    t = create_transport(
        transport_name, load_config({"transport": transport_name}), agent_name=str(me)
    )
    _cache, geo = make_cache(seed=1)
    t.register(geo.regions())
    local_table = t.prepare(geo.slot_table())
    conn.send_bytes(CODEC.encode(hello(Hello, me, t, geo)))
    welcome = CODEC.decode(conn.recv_bytes())
    assert isinstance(welcome, Welcome)
    peer = t.add_peer(welcome.transport_metadata)
    remote_table = t.prepare(welcome.geometry.slot_table(), peer=peer)

    dest = CODEC.decode(conn.recv_bytes())
    assert isinstance(dest, Destination)
    my_blocks = list(range(len(dest.block_ids)))  # the prompt's blocks on this side
    start = time.perf_counter()
    plan = plan_blocks(geo, welcome.geometry, my_blocks, dest.block_ids)  # once per request
    xfers = []
    for layer in range(LAYERS):  # an engine does this from save_kv_layer, as layers finish
        part = plan.for_layer(layer)
        note = CODEC.encode(
            LayerDone(
                transfer_id=dest.transfer_id,
                layers=[layer],
                first_block=0,
                num_blocks=len(my_blocks),
            )
        )
        xfers.append(
            t.post(
                "write", local_table, part.local_slots, remote_table, part.remote_slots, notify=note
            )
        )
    for x in xfers:
        t.wait(x, timeout=30)
        t.release(x)
    t.notify(peer, CODEC.encode(Done(transfer_id=dest.transfer_id)))
    print(
        f"prefill: sent {LAYERS} layers x {len(my_blocks)} blocks in "
        f"{(time.perf_counter() - start) * 1e3:.1f} ms"
    )
    conn.recv_bytes()  # decode has verified; now it is safe to close
    t.close()


def decode(conn, transport_name: str) -> None:
    me = PeerId(engine_id="decode", epoch=uuid.uuid4().hex[:8])
    t = create_transport(
        transport_name, load_config({"transport": transport_name}), agent_name=str(me)
    )
    cache, geo = make_cache(seed=None)
    t.register(geo.regions())
    hello_msg = CODEC.decode(conn.recv_bytes())
    assert isinstance(hello_msg, Hello)
    t.add_peer(hello_msg.transport_metadata)
    conn.send_bytes(CODEC.encode(hello(Welcome, me, t, geo)))

    blocks = [40, 41, 42, 7, 8]  # whatever the allocator handed out
    conn.send_bytes(
        CODEC.encode(
            Destination(transfer_id="req-1", peer=me, block_ids=blocks, num_tokens=5 * BLOCK_SIZE)
        )
    )
    layers_seen, done = set(), False
    deadline = time.monotonic() + 30
    while not done:
        if time.monotonic() > deadline:
            raise TimeoutError("KV did not arrive within 30 s")
        for note in t.take_notifications(timeout=1.0):
            msg = CODEC.decode(note.payload)
            if isinstance(msg, LayerDone):
                layers_seen.update(msg.layers)
            elif isinstance(msg, Done):
                done = True
    expected, _ = make_cache(seed=1)
    for i, b in enumerate(blocks):
        np.testing.assert_array_equal(cache[:, b], expected[:, i])
    print(
        f"decode: layers {sorted(layers_seen)} arrived; {len(blocks)} blocks in every layer "
        "verified"
    )
    conn.send_bytes(b"ok")
    t.close()


def main() -> int:
    transport_name = sys.argv[1] if len(sys.argv) > 1 else "nixl"
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    procs = [
        ctx.Process(target=prefill, args=(a, transport_name)),
        ctx.Process(target=decode, args=(b, transport_name)),
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    codes = [p.exitcode for p in procs]
    print("verified" if codes == [0, 0] else f"failed: exit codes {codes}")
    return 0 if codes == [0, 0] else 1


if __name__ == "__main__":
    sys.exit(main())
