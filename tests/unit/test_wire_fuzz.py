"""Seeded fuzzing of every decoder kvbridge exposes to the network: the side channel's and
the transport notifications' frames (:class:`~kvbridge.wire.codec.Codec`, with and
without a secret), the SGLang backend's control messages and notifications
(:mod:`kvbridge.wire.room_messages`), and what ``kvbridge proxy`` parses of a
client's request and of a prefill's answer (:mod:`kvbridge.proxy.app`; it may raise
only its own HTTP error).

Inputs: valid frames of every message, mutated (bytes flipped, cut, repeated, length
prefixes inflated, nesting headers spliced in), and random bytes. A decoder may raise
only kvbridge's own :class:`~kvbridge.errors.KVBridgeError`, must answer each input
within half a second of its own thread's CPU time and ten of wall time (a hang or a
quadratic blow-up, not a speed figure: on a loaded machine a case waits for a core, so
the CPU time is what is bounded tightly; a case over either bound is timed once more,
so that a garbage collection of the test process that lands in it is not blamed on the
decoder), and may not keep or balloon memory."""

from __future__ import annotations

import gc
import json
import random
import time
import tracemalloc
from collections.abc import Callable, Iterator
from types import SimpleNamespace

import msgspec
import pytest
from test_wire import ALL_MESSAGES, INFO

from kvbridge.core.layout import MAX_PLANES, CacheGeometry, CacheSpec
from kvbridge.errors import IncompatiblePeerError, KVBridgeError, WireError
from kvbridge.proxy.app import MAX_DP_RANKS, UpstreamError, parse_request, read_prefill_answer
from kvbridge.proxy.pool import Instance
from kvbridge.runtime.node import Node
from kvbridge.wire import room_messages as sg
from kvbridge.wire.auth import ReplayGuard
from kvbridge.wire.codec import Codec
from kvbridge.wire.messages import (
    MAX_BLOCK_IDS,
    MAX_GROUPS,
    MAX_LAYERS,
    Destination,
    Hello,
    LayerDone,
    PeerId,
)

CASES = 20_000
"""Per decoder (about 0.6 s each here; the whole file stays under 10 s)."""
CASE_BOUND_S = 0.5
"""CPU seconds of the decoding thread per case: a quadratic blow-up or a hang on the CPU,
whatever else the machine runs."""
CASE_WALL_S = 10.0
"""Wall seconds per case: a decoder that waits (nothing here should)."""
PEAK_BYTES = 64 << 20
SECRET = b"fuzz"

_LENGTH_BOMBS = (b"\xdd\xff\xff\xff\x7f", b"\xdf\xff\xff\xff\x7f", b"\xc6\xff\xff\xff\x7f")
"""msgpack headers of an array, a map and a bin claiming ~2**31 elements or bytes."""


def _mutate(rng: random.Random, seed: bytes) -> bytes:
    data = bytearray(seed)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(7)
        at = rng.randrange(len(data) + 1)
        if op == 0 and data:  # flip a byte
            data[min(at, len(data) - 1)] = rng.randrange(256)
        elif op == 1:  # cut
            data = data[:at]
        elif op == 2:  # splice in deep nesting
            data[at:at] = b"\x91" * rng.choice((10, 500, 5000)) + b"\xc0"
        elif op == 3:  # a length prefix claiming billions
            data[at:at] = rng.choice(_LENGTH_BOMBS)
        elif op == 4:  # repeat a slice
            piece = data[at : at + rng.randint(1, 64)]
            data[at:at] = piece * rng.randint(1, 50)
        elif op == 5:  # random bytes
            data[at:at] = rng.randbytes(rng.randint(1, 32))
        else:  # a whole random input
            data = bytearray(rng.randbytes(rng.randint(0, 256)))
    return bytes(data)


def _inputs(seeds: list[bytes], rng: random.Random, cases: int = CASES) -> Iterator[bytes]:
    yield from seeds
    for i in range(cases):
        yield _mutate(rng, seeds[i % len(seeds)])


def _fuzz(
    decode: Callable[[bytes], object],
    seeds: list[bytes],
    seed: int,
    allowed: type[Exception] = KVBridgeError,
    cases: int = CASES,
) -> None:
    """Decode ``seeds`` and ``cases`` mutations of them; ``allowed``: the one exception
    type the decoder may raise (kvbridge's, or the proxy's HTTP error)."""
    rng = random.Random(seed)
    tracemalloc.start()
    try:
        for data in _inputs(seeds, rng, cases):
            took, worked = _decode_timed(decode, data, allowed)
            if worked >= CASE_BOUND_S or took >= CASE_WALL_S:
                # once more, without the collector: a full collection of the whole test
                # process (under tracemalloc) can land in any case; a slow decoder is
                # slow twice
                gc.disable()
                try:
                    again = _decode_timed(decode, data, allowed)
                finally:
                    gc.enable()
                took, worked = min(took, again[0]), min(worked, again[1])
            assert worked < CASE_BOUND_S, f"{worked:.2f} s of CPU on input {data[:80]!r}..."
            assert took < CASE_WALL_S, f"{took:.2f} s on input {data[:80]!r}..."
        current, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < PEAK_BYTES, f"decoding peaked at {peak >> 20} MiB"
    assert current < 1 << 20, f"{current >> 10} KiB still held after decoding"


def _decode_timed(
    decode: Callable[[bytes], object], data: bytes, allowed: type[Exception]
) -> tuple[float, float]:
    """Wall and thread-CPU seconds that ``decode(data)`` took; fails the test on any
    exception but ``allowed``."""
    start, cpu = time.perf_counter(), time.thread_time()
    try:
        decode(data)
    except allowed:
        pass
    except Exception as exc:  # noqa: BLE001 - the failure this test looks for
        pytest.fail(f"{type(exc).__name__} on input {data[:80]!r}...: {exc}")
    return time.perf_counter() - start, time.thread_time() - cpu


def _frames(codec: Codec) -> list[bytes]:
    return [codec.encode(msg) for msg in ALL_MESSAGES]


def test_fuzz_side_channel_frames() -> None:
    codec = Codec(INFO)
    seeds = _frames(codec)
    # a peer of another compatibility class: the error path that reads its handshake
    other = _frames(Codec(msgspec.structs.replace(INFO, model="another")))
    for frame in other:
        with pytest.raises(IncompatiblePeerError):
            codec.decode(frame)
    seeds += other
    _fuzz(codec.decode, seeds, seed=1)


def test_fuzz_authenticated_notifications() -> None:
    """:meth:`kvbridge.runtime.node.Node.decode_note` with a secret: the MAC, the stamp
    and the replay set first, then the codec."""
    codec = Codec(INFO)

    def node(agent: str) -> SimpleNamespace:
        return SimpleNamespace(
            _secret=SECRET,
            codec=codec,
            transport=SimpleNamespace(agent_name=agent),
            note_replays=ReplayGuard(),
        )

    p, d = node("p"), node("d")

    def decode(data: bytes) -> object:
        return Node.decode_note(d, data, "p")

    seeds = [Node.encode_note(p, msg, "d") for msg in ALL_MESSAGES]
    # mutations of the frame under a recomputed MAC reach the decoder
    rng = random.Random(2)
    mutated = [_mutate(rng, f) for f in _frames(codec) for _ in range(3)]
    p.codec = SimpleNamespace(encode=lambda frame: frame)  # seal the mutated frames as they are
    seeds += [Node.encode_note(p, frame, "d") for frame in mutated]
    _fuzz(decode, seeds, seed=3)


SG_SPEC = CacheSpec(
    num_layers=2, block_size=1, num_kv_heads=2, head_dim=8, dtype="float32", layout="fused"
)


def _sglang_messages() -> list[sg.Message]:
    from kvbridge.core.rows import RowLayout

    geo = CacheGeometry(spec=SG_SPEC, num_blocks=8, plane_bases=(1 << 20, 1 << 21))
    return [
        sg.Registration(
            agent="d",
            epoch="e",
            transport="nixl",
            transport_md=b"md",
            geometry=geo,
            aux=RowLayout(ptrs=(1 << 22,), item_lens=(4,), rows=2),
            ip="127.0.0.1",
            port=5,
        ),
        sg.Destination(
            room=7,
            agent="d",
            ip="127.0.0.1",
            port=5,
            pages=sg.encode_pages([3, 4]),
            aux_index=1,
            required_dst_info_num=1,
        ),
        sg.Done(room=7, prefill_rank=0, epoch="e", pages=2, bytes=64),
    ]


@pytest.mark.parametrize("secret", [None, SECRET], ids=["no-secret", "secret"])
def test_fuzz_sglang_control_messages(secret: bytes | None) -> None:
    at, guard = "tcp://10.0.0.1:7000", ReplayGuard()

    def decode(data: bytes) -> object:
        # frames: tag, payload and (with a secret) a MAC and a stamp cut from its tail
        frames = [sg.TAG, data] if secret is None else [sg.TAG, data[:-40], data[-40:-8], data[-8:]]
        try:
            if secret is not None:
                frames = sg.unsign(frames, secret, at, guard)
            return sg.decode(frames)
        except sg.AuthenticationError as exc:  # what the prefill reads of a refused one
            return exc.unverified

    seeds = [b"".join(sg.sign(sg.encode(msg), secret, at)[1:]) for msg in _sglang_messages()]
    _fuzz(decode, seeds, seed=4)


@pytest.mark.parametrize("secret", [None, SECRET], ids=["no-secret", "secret"])
def test_fuzz_sglang_notifications(secret: bytes | None) -> None:
    guard = ReplayGuard()
    seeds = [sg.encode_payload(msg, secret, sender="p", receiver="d") for msg in _sglang_messages()]
    _fuzz(
        lambda data: sg.decode_payload(data, secret, sender="p", receiver="d", guard=guard),
        seeds,
        seed=5,
    )


def _refused_cheaply(codec: Codec, frame: bytes) -> None:
    tracemalloc.start()
    try:
        with pytest.raises(WireError, match="length"):
            codec.decode(frame)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # the list is refused from its header: nothing near the claimed size is built
    assert peak < 4 << 20, f"refusing it peaked at {peak >> 20} MiB"


def test_lists_past_their_bound_are_refused_before_they_are_built() -> None:
    """A peer claiming more block ids, groups, layers or planes than any real cache has
    is refused while its header is read; at the bound a message still decodes (a
    16M-token prompt in 16-token blocks)."""
    codec = Codec(INFO)
    peer = PeerId(engine_id="d", epoch="e")
    at_bound = Destination(transfer_id="t", peer=peer, block_ids=[1] * MAX_BLOCK_IDS, num_tokens=1)
    assert codec.decode(codec.encode(at_bound)) == at_bound
    over = msgspec.structs.replace(at_bound, block_ids=[1] * (MAX_BLOCK_IDS + 1))
    _refused_cheaply(codec, codec.encode(over))
    groups = msgspec.structs.replace(
        at_bound, block_ids=[1], group_block_ids=[[1]] * (MAX_GROUPS + 1)
    )
    _refused_cheaply(codec, codec.encode(groups))
    in_group = msgspec.structs.replace(
        at_bound, block_ids=[1], group_block_ids=[[1] * (MAX_BLOCK_IDS + 1)]
    )
    _refused_cheaply(codec, codec.encode(in_group))
    layers = LayerDone(transfer_id="t", layers=[0] * (MAX_LAYERS + 1), first_block=0, num_blocks=1)
    _refused_cheaply(codec, codec.encode(layers))
    hello = next(m for m in ALL_MESSAGES if isinstance(m, Hello))
    spec = msgspec.structs.replace(hello.geometry.spec, num_layers=MAX_PLANES + 1)
    planes = tuple(range(1, 1 + spec.num_layers * spec.planes_per_layer))
    huge = CacheGeometry(spec=spec, num_blocks=1, plane_bases=planes)
    _refused_cheaply(codec, codec.encode(msgspec.structs.replace(hello, geometry=huge)))


_JSON_BOMBS = (
    b"[" * 5000,
    b'{"a":' * 5000,
    b"1" * 5000,
    b"1e999999",
    b"-0.0e-99999",
    b'"\\ud800"',
    b"NaN",
    b"\xff\xfe",
    b'"' + b"\\" * 3,
)
"""JSON that a naive reader chokes on: deep nesting, a 5,000-digit integer, an infinite
float, a lone surrogate, invalid UTF-8."""


def _mutate_json(rng: random.Random, seed: bytes) -> bytes:
    if rng.random() < 0.5:
        return _mutate(rng, seed)
    data = bytearray(seed)
    for _ in range(rng.randint(1, 3)):
        at = rng.randrange(len(data) + 1)
        data[at:at] = rng.choice(_JSON_BOMBS)
    return bytes(data)


def _fuzz_json(decode: Callable[[bytes], object], seeds: list[bytes], seed: int) -> None:
    rng = random.Random(seed)
    cases = seeds + [_mutate_json(rng, seeds[i % len(seeds)]) for i in range(PROXY_CASES)]
    _fuzz(decode, cases, seed=seed, allowed=UpstreamError, cases=0)


PROXY_CASES = 15_000
"""Per parser of the proxy (json.loads is fast; the seeds' shapes matter more)."""


def _json(obj: object) -> bytes:
    return json.dumps(obj).encode()


def test_fuzz_proxy_request_bodies() -> None:
    """What ``kvbridge proxy`` reads of a client: only its 400 (``UpstreamError``)."""
    seeds = [
        _json({"model": "m", "prompt": "hello", "max_tokens": 4, "stream": True}),
        _json({"model": "m", "messages": [{"role": "user", "content": "hi"}], "n": 2}),
        _json({"prompt": [1, 2, 3], "kv_transfer_params": {"kvbridge": {"role": "decode"}}}),
    ]
    _fuzz_json(parse_request, seeds, seed=6)


def test_fuzz_proxy_prefill_answers() -> None:
    """What the proxy reads of a prefill's answer (the side-channel address it learns, DP
    ranks included): only its 502 naming the instance, and no instance ends up with
    addresses for more DP ranks than it probes."""
    p = Instance(url="http://prefill", role="prefill")

    def read(data: bytes) -> object:
        _, address = read_prefill_answer(p, data)
        if address is not None:
            p.learn(address)
        assert len(p.addresses) <= MAX_DP_RANKS
        return address

    address = {"address": "tcp://10.0.0.1:5557", "engine_id": "e", "epoch": "x", "dp_rank": 1}
    seeds = [
        _json({"choices": [{"text": "x"}], "kv_transfer_params": None}),
        _json({"kv_transfer_params": {"kvbridge": {"prefill": address}}}),
        _json({"kv_transfer_params": {"kvbridge": {"prefill": {**address, "dp_rank": 0}}}}),
        _json({"kv_transfer_params": {"do_remote_decode": False, "remote_block_ids": [1, 2]}}),
    ]
    _fuzz_json(read, seeds, seed=7)


def _spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_the_harness_fails_a_decoder_slow_on_an_input_and_forgives_one_pause() -> None:
    """The bound catches a decoder that is slow on an input every time it sees it, and
    not one whose case met a pause once (a garbage collection of the test process)."""
    with pytest.raises(AssertionError, match="s of CPU on input b'slow'"):
        _fuzz(lambda data: _spin(CASE_BOUND_S + 0.1), [b"slow"], seed=1, cases=0)
    paused: list[bytes] = []

    def pauses_once(data: bytes) -> None:
        if data not in paused:
            paused.append(data)
            _spin(CASE_BOUND_S + 0.1)

    _fuzz(pauses_once, [b"once"], seed=1, cases=0)
