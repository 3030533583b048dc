"""SGLang's data parallelism, and several decode servers fed by one prefill, through
kvbridge between real servers (NIXL and Mooncake over loopback):

- DP replicas (``--dp-size 2``: two schedulers behind SGLang's DP controller, each with
  its own KV pool) on both sides. The prefill's controller hands a request to replica
  ``room % 2`` (``follow_bootstrap_room``, its default) or in turn (``round_robin``; the
  replica then tells the bootstrap server, which the decode asks), the decode's in turn.
  SGLang 0.5.23's sender takes every replica for DP rank 0 and fails each room sent to
  replica 1 (its own backends then leave the decode waiting until their timeouts);
  kvbridge's manager names its replica (``compat.serve_replica_dp_rank``). With both
  sides balancing by room a request with ``n = 2`` pairs its samples; a server whose DP
  ranks take requests otherwise warns at start that such requests will not pair.
- DP attention (``--tp 2 --attn-dp-size 2``: attention data parallel, the MLP tensor
  parallel) on both sides, with the tiny DeepSeek-V2 (MLA, the models SGLang's DP
  attention is for; it runs here through the test plugin
  ``tests/sglang_stubs/sglang_cpu_dp_attention``).
- Two decode servers fed by one prefill: each decode rank is a peer of its own (every
  server's first rank used to replace the other's, whose next request then failed as
  an "unknown decode peer"); a decode restarted on its address replaces its old agent.
- A decode whose request comes after the prefill gave the room up (SGLang's bootstrap
  timeout) fails at once, naming it, instead of waiting for KV that never comes.

The tests pick each request's bootstrap room and send it to both servers themselves
(``sglang_helpers.route``: what sglang_router's mini_lb does with a random room), so
they know which DP rank serves which room; each prefill DP rank must log the rooms it
sent and the decode agents it registered. Greedy output equals a colocated TP 1
server's token for token. Each test starts its own servers."""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
from sglang_helpers import (
    ENGINE_FLAGS,
    PD_FLAGS,
    START_TIMEOUT_S,
    TWO_RANKS,
    Proc,
    generate_routed,
    http,
    kv_bytes,
    kvbridge_metrics,
    latent_bytes,
    peers_by_dp_rank,
    prompt_ids,
    reference_ids,
    room_of,
    route_body,
    routed_body,
    sends_by_dp_rank,
    server_env,
    wait_received_bytes,
    wait_staging_idle,
)

from kvbridge.demo.servers import free_port, start_all
from kvbridge.demo.sglang_servers import SglangServer

pytestmark = pytest.mark.timeout(900)

PROMPTS = (12, 40, 77, 200)  # under a page, pages in one chunk, two chunks, four
RESIDUES = (0, 0, 1, 1)
"""Each prompt's room modulo the DP size. Two rooms in a row on each prefill rank: the
decode's controller hands consecutive requests to its two ranks in turn, so each prefill
rank meets both decode ranks."""


def _flags(mode: str, bootstrap: int) -> list[str]:
    flags = ["--disaggregation-mode", mode, "--disaggregation-transfer-backend", "kvbridge"]
    if mode == "prefill":
        return [*flags, "--disaggregation-bootstrap-port", str(bootstrap), *PD_FLAGS]
    return [*flags, "--disaggregation-decode-retraction-backup", "cpu_tensor", *PD_FLAGS]


def _server(
    model: Path, log: Path, mode: str, bootstrap: int, args, env, port: int | None = None
) -> SglangServer:
    return SglangServer(
        model,
        port=port,
        extra_args=[*ENGINE_FLAGS, *_flags(mode, bootstrap), *args],
        env=env,
        log_path=log,
        nice=19,
    ).start()


@contextmanager
def servers(model: Path, log_dir: Path, sides: list[tuple[str, list[str], dict]]):
    """Start one server per ``(mode, args, env)`` of ``sides`` (the prefill first),
    ready; yields ``(bootstrap_port, servers)``, kills them all at the end."""
    bootstrap = free_port()
    procs: list[SglangServer] = []
    try:
        for i, (mode, args, env) in enumerate(sides):
            procs.append(_server(model, log_dir / f"{mode}{i}.log", mode, bootstrap, args, env))
        start_all(procs, START_TIMEOUT_S)
        yield bootstrap, procs
    finally:
        for proc in reversed(procs):
            proc.kill()


BY_ROOM = ["--load-balance-method", "follow_bootstrap_room"]
ROUND_ROBIN = ["--load-balance-method", "round_robin"]
UNPAIRED_SAMPLES = "requests with n > 1 (parallel sampling) then fail or wait"
"""What kvbridge warns at start on a server whose DP ranks are not assigned by room."""


def _check_dp_ranks(
    prefill: Proc, offset: int, rooms: list[int], *, by_room: bool, decode_by_room: bool
) -> None:
    """Each room was sent by one prefill DP rank: rank ``room % 2`` when the prefill
    balances by room, and both ranks sent some; with the decode's DP ranks taking
    requests in turn, each prefill rank registered both as peers of their own
    (:data:`RESIDUES`); and no registration replaced another (the prefill's
    ``peers_replaced`` counter)."""
    sent = sends_by_dp_rank(prefill, offset, rooms)
    assert set(sent.values()) == {0, 1}, f"both prefill DP ranks send: {sent}"
    if by_room:
        assert all(dp == room % 2 for room, dp in sent.items()), (
            f"rooms are sent by the prefill's DP rank room % 2: {sent}"
        )
    if by_room and not decode_by_room:
        peers = peers_by_dp_rank(prefill)
        assert {dp: len(agents) for dp, agents in peers.items()} == {0: 2, 1: 2}, (
            f"each prefill DP rank registers both decode DP ranks: {peers}"
        )
        assert peers[0] == peers[1], peers
    assert peer_counts(prefill)[1] == 0, (
        f"a decode DP rank's registration replaced another's:\n{prefill.log_tail()}"
    )


def peer_counts(prefill: Proc) -> tuple[int, int]:
    """The decode ranks ``prefill``'s ranks registered and replaced (a restarted rank's
    new agent), from its kvbridge counters."""
    got = kvbridge_metrics(prefill.url)
    return (
        int(got.get("sglang:kvbridge_peers_registered_total", 0)),
        int(got.get("sglang:kvbridge_peers_replaced_total", 0)),
    )


def _check_warned(server: Proc, *, warned: bool) -> None:
    assert (UNPAIRED_SAMPLES in server.log_path.read_text(errors="replace")) == warned, (
        f"{server.log_path.name}: kvbridge's start-up warning about DP balancing for n > 1 "
        f"{'missing' if warned else 'logged by a server balancing by room'}"
    )


REPLICA_PAIRS = {
    # both sides by room: a request's samples (n > 1) pair too
    "nixl-layer-by-room": ({"transport": "nixl", "layerwise_min_tokens": 0}, [], BY_ROOM),
    # the prefill in turn: each rank tells the bootstrap server, the decode asks it
    "mooncake-chunk-packed-round-robin": (
        {"transport": "mooncake", "layerwise": False, "data_path": "packed"},
        ROUND_ROBIN,
        [],
    ),
}


@pytest.mark.parametrize(
    "pair",
    [pytest.param(p, marks=pytest.mark.extended) if "mooncake" in p else p for p in REPLICA_PAIRS],
)  # the round-robin warning itself is unit-tested (tests/unit/test_sglang_adapter.py)
def test_dp_replicas_serve_every_room_as_colocated(
    pair: str, model: Path, colocated: Proc, tmp_path_factory: pytest.TempPathFactory
) -> None:
    config, prefill_balancing, decode_balancing = REPLICA_PAIRS[pair]
    inputs = {n: prompt_ids(n, seed=1200 + n) for n in PROMPTS}
    want = {n: reference_ids(colocated, ids) for n, ids in inputs.items()}
    env = {**server_env(config), **TWO_RANKS}
    replicas = ["--dp-size", "2"]
    sides = [
        ("prefill", [*replicas, *prefill_balancing], env),
        ("decode", [*replicas, *decode_balancing], env),
    ]
    with servers(model, tmp_path_factory.mktemp(f"dp-{pair}"), sides) as (bootstrap, procs):
        prefill, decode = procs
        offset = prefill.log_path.stat().st_size
        before = kvbridge_metrics(decode.url)
        rooms = []
        for i, (n, residue) in enumerate(zip(PROMPTS, RESIDUES, strict=True)):
            rooms.append(room_of(residue, 2, seed=i))
            got = generate_routed(prefill, bootstrap, decode, inputs[n], rooms[-1])
            assert got == want[n], f"{n} tokens (room {rooms[-1]}): {got} != colocated {want[n]}"
        by_room = prefill_balancing != ROUND_ROBIN
        _check_dp_ranks(
            prefill, offset, rooms, by_room=by_room, decode_by_room=bool(decode_balancing)
        )
        if config.get("data_path") != "packed":
            expected = sum(kv_bytes(model, decode, n) for n in PROMPTS)
            assert wait_received_bytes(decode.url, before, expected) == expected
        else:
            for server in (prefill, decode):
                wait_staging_idle(server)
        _check_warned(prefill, warned=not by_room)
        _check_warned(decode, warned=not decode_balancing)
        if by_room and decode_balancing:
            # a request's primer and samples reach one DP rank on each side: they pair
            n = PROMPTS[1]
            body = routed_body(inputs[n], bootstrap, room_of(1, 2, seed=9))
            body["sampling_params"]["n"] = 2
            answers = route_body(prefill, decode, body)
            status, data = answers.decode
            assert status == 200, f"n = 2: {status} {data[:300]!r}\n{decode.log_tail()}"
            samples = [out["output_ids"] for out in json.loads(data)]
            assert samples == [want[n], want[n]], f"greedy samples equal n = 1's: {samples}"


@pytest.fixture(scope="module")
def colocated_mla(mla_model: Path, shared_colocated) -> Proc:
    return shared_colocated(mla_model)


def test_dp_attention_serves_every_room_as_colocated(
    mla_model: Path, colocated_mla: Proc, tmp_path_factory: pytest.TempPathFactory
) -> None:
    inputs = {n: prompt_ids(n, seed=1300 + n) for n in PROMPTS}
    want = {n: reference_ids(colocated_mla, ids) for n, ids in inputs.items()}
    env = {**server_env({"transport": "nixl", "layerwise_min_tokens": 0}), **TWO_RANKS}
    dp_attention = ["--tp", "2", "--attn-dp-size", "2"]
    sides = [
        ("prefill", dp_attention, env),
        # SGLang's default LM-head all-to-all on a DP-attention decode has no CPU kernel
        ("decode", [*dp_attention, "--no-enable-tp-lm-head-all-to-all"], env),
    ]
    with servers(mla_model, tmp_path_factory.mktemp("dp-attention"), sides) as (bootstrap, procs):
        prefill, decode = procs
        offset = prefill.log_path.stat().st_size
        before = kvbridge_metrics(decode.url)
        rooms = []
        for i, (n, residue) in enumerate(zip(PROMPTS, RESIDUES, strict=True)):
            rooms.append(room_of(residue, 2, seed=10 + i))
            got = generate_routed(prefill, bootstrap, decode, inputs[n], rooms[-1])
            assert got == want[n], f"{n} tokens (room {rooms[-1]}): {got} != colocated {want[n]}"
        _check_dp_ranks(prefill, offset, rooms, by_room=True, decode_by_room=False)
        _check_warned(prefill, warned=False)
        _check_warned(decode, warned=True)  # its DP ranks take requests in turn
        # each attention-DP rank holds its requests' latent pages: each room moves once
        expected = sum(latent_bytes(mla_model, decode, n) for n in PROMPTS)
        assert wait_received_bytes(decode.url, before, expected) == expected


BOOTSTRAP_TIMEOUT_S = 15
"""The prefill's SGLang bootstrap timeout in the two-decode test (default 300 s): how
long a room waits for its decode's destination before the prefill gives it up."""
LATE_ANSWER_S = 30.0
"""A decode request for a room the prefill gave up is answered within this (kvbridge's
own wait for KV, ``timeouts.receive_s``, is 120 s)."""


# `make test-all` only: the seats on real prefill methods run in test_sglang_prefill_peers
@pytest.mark.extended
def test_two_decode_servers_are_peers_of_their_own_and_a_restart_replaces_one(
    model: Path, colocated: Proc, tmp_path_factory: pytest.TempPathFactory
) -> None:
    inputs = {n: prompt_ids(n, seed=1400 + n) for n in PROMPTS}
    want = {n: reference_ids(colocated, ids) for n, ids in inputs.items()}
    env = server_env({"transport": "nixl", "layerwise_min_tokens": 0})
    prefill_env = {**env, "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": str(BOOTSTRAP_TIMEOUT_S)}
    log_dir = tmp_path_factory.mktemp("two-decodes")
    sides = [("prefill", [], prefill_env), ("decode", [], env), ("decode", [], env)]
    with servers(model, log_dir, sides) as (bootstrap, procs):
        prefill, *decodes = procs
        for i, n in enumerate(PROMPTS):  # decode 0, 1, 0, 1
            got = generate_routed(
                prefill, bootstrap, decodes[i % 2], inputs[n], room_of(0, 1, 20 + i)
            )
            assert got == want[n], f"{n} tokens through decode {i % 2}: {got} != {want[n]}"
        assert peer_counts(prefill) == (2, 0), (
            f"each decode server registered once, neither replaced:\n{prefill.log_tail()}"
        )

        # the prefill gives a room up (its bootstrap timeout) before the decode's request
        # comes: the decode fails it at once, with the prefill's reason
        body = routed_body(inputs[PROMPTS[1]], bootstrap, room_of(0, 1, 30))
        wait = BOOTSTRAP_TIMEOUT_S + LATE_ANSWER_S
        status, data = http(f"{prefill.url}/generate", body, timeout=wait)
        assert status not in (0, 200), f"the prefill served a room no decode asked for: {status}"
        started = time.monotonic()
        status, data = http(f"{decodes[1].url}/generate", body, timeout=LATE_ANSWER_S)
        assert status != 0, (
            f"no answer within {LATE_ANSWER_S:.0f} s for a room the prefill gave up:\n"
            f"{decodes[1].log_tail()}"
        )
        assert status != 200 and b"timed out" in data, (status, data[:500])
        print(f"late decode request answered {status} in {time.monotonic() - started:.1f} s")

        # decode 0 restarts on its address: its new agent replaces the old one, decode 1 stays
        port = decodes[0].port
        decodes[0].kill()
        decodes[0] = _server(
            model, log_dir / "decode0-restarted.log", "decode", bootstrap, [], env, port
        )
        decodes[0].wait_ready(START_TIMEOUT_S)
        for i, n in enumerate(PROMPTS[:2]):
            got = generate_routed(
                prefill, bootstrap, decodes[i % 2], inputs[n], room_of(0, 1, 40 + i)
            )
            assert got == want[n], f"after the restart, {n} tokens through decode {i % 2}"
        assert peer_counts(prefill) == (3, 1), (
            f"decode 0's new agent registered and replaced its old one:\n{prefill.log_tail()}"
        )
