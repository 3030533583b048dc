"""A model with state-space layers through kvbridge between real SGLang servers: SGLang
keeps such a model (Qwen3-Next, Nemotron-H, Granite 4.0-H, LFM2, ...) in a hybrid pool,
its attention layers' KV in pages and each state-space layer's state (convolution
window, SSM state) in one slot per request. The test model: the tiny LFM2 of
``kvbridge.demo.model`` (4 layers alternating gated short convolutions of width 3 and
attention), the one such architecture SGLang computes on this CPU (with the test-only
``sglang_cpu_conv`` plugin, tests/sglang_stubs/README.md).

Two pairs (:data:`PD_CONFIGS`): the direct path over NIXL per layer, and FP8 on the wire
over Mooncake per chunk between a prefill and a decode of two attention TP ranks each
(each rank holds half of every state's channels and moves them to its peer rank). The
KV moves by the pair's path, the states always exact, after the prompt's last chunk. For prompts
inside one page to several chunks: greedy output equals a colocated server's token for
token (FP8 with TP 2: the decode's first computed token within FP8 noise of a colocated
TP 1 server's), and the decode received exactly the attention layers' pages of the
prompt plus one state per state-space layer, as bytes of the path's format (every head
and channel once). A state left behind, or written to another slot, changes
the decode's tokens from the first one it computes.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest
from sglang_helpers import (
    PD,
    Proc,
    check_sent_lines,
    fp8_bytes,
    generate_as_colocated,
    kv_bytes,
    kvbridge_metrics,
    pd_config,
    prompt_ids,
    start_colocated,
    start_pd,
    tp_sides,
    wait_received_bytes,
    wait_staging_idle,
)

# inside a page, one chunk, several chunks
PROMPTS = [5, 64, 200]
STATE_FLAGS = ["--max-mamba-cache-size", "64", "--disable-radix-cache"]
"""SGLang sizes its state pool from free memory otherwise (3 million slots, 3 GB here);
its radix cache for such models needs state snapshots (CUDA and a few other platforms)
or pages of one token on this CPU."""


@pytest.fixture(scope="module")
def conv_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvbridge.demo.model import build_tiny_model

    return build_tiny_model(tmp_path_factory.getbasetemp() / "shortconv-lfm2", shape="shortconv")


@pytest.fixture(scope="module")
def colocated_conv(conv_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    yield from start_colocated(
        conv_model, tmp_path_factory.mktemp("conv-colocated"), extra=STATE_FLAGS
    )


# (transport, per layer, wire, attention TP of both sides). Each rank holds its share of
# a state's channels (and of the KV heads) and moves its own to the decode rank of its
# rank.
PD_CONFIGS = [("nixl", True, "direct", 1), ("mooncake", False, "fp8", 2)]
WIRE = {"direct": {}, "fp8": {"wire_dtype": "fp8"}}


class StatePD(NamedTuple):
    pd: PD
    wire: str
    tp: int


@pytest.fixture(
    scope="module",
    params=PD_CONFIGS,
    ids=[f"{t}-{'layer' if lw else 'chunk'}-{w}-tp{tp}" for t, lw, w, tp in PD_CONFIGS],
)
def state_pd(
    request: pytest.FixtureRequest, conv_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[StatePD]:
    transport, layerwise, wire, tp = request.param
    log_dir = tmp_path_factory.mktemp(f"conv-{transport}-{wire}")
    sides = tp_sides({**pd_config(transport, layerwise), **WIRE[wire]}, tp, tp)
    env = sides.pop("env")
    sides["prefill_args"] = [*sides["prefill_args"], *STATE_FLAGS]
    sides["decode_args"] = [*sides["decode_args"], *STATE_FLAGS]
    for pd in start_pd(conv_model, log_dir, env, layerwise, **sides):
        yield StatePD(pd, wire, tp)


def state_bytes(model: Path) -> int:
    """One request's states of the model, from its config: per short-convolution layer
    the last ``conv_L_cache - 1`` inputs of its ``hidden_size`` channels, in bfloat16
    (SGLang's conv-state dtype unless ``SGLANG_MAMBA_CONV_DTYPE`` says otherwise)."""
    cfg = json.loads((model / "config.json").read_text())
    layers = cfg["layer_types"].count("conv")
    return layers * cfg["hidden_size"] * (cfg["conv_L_cache"] - 1) * 2


def attention_share(model: Path) -> float:
    """The share of the model's layers that are attention layers (the KV pool's)."""
    kinds = json.loads((model / "config.json").read_text())["layer_types"]
    return kinds.count("full_attention") / len(kinds)


@pytest.mark.parametrize("n", PROMPTS)
def test_state_space_output_equals_colocated(
    state_pd: StatePD, colocated_conv: Proc, conv_model: Path, n: int
) -> None:
    pd, fp8 = state_pd.pd, state_pd.wire == "fp8"
    input_ids = prompt_ids(n, seed=1700 + n)
    offset = pd.prefill.log_path.stat().st_size
    before = kvbridge_metrics(pd.decode.url)
    generate_as_colocated(pd, colocated_conv, input_ids, fp8=fp8)
    # one line per prefill rank; per layer: the attention layers (the states go after
    # the last chunk)
    check_sent_lines(pd, offset, state_pd.tp)
    # the helpers count every layer's pages; the pool holds the attention layers'
    kv = fp8_bytes(conv_model, n) if fp8 else kv_bytes(conv_model, pd.decode, n)
    kv = kv * attention_share(conv_model)
    expected = kv + state_bytes(conv_model)
    received = wait_received_bytes(pd.decode.url, before, expected)
    assert received == expected, (
        f"{n} tokens: the decode received {received} bytes, the prompt's attention pages are "
        f"{kv} and its states {state_bytes(conv_model)}"
    )
    if fp8:
        wait_staging_idle(pd.prefill)
        wait_staging_idle(pd.decode)
