"""The TTFT breakdowns' arithmetic (``benchmarks/ttft_breakdown.py``, ``sglang_ttft.py``,
``ttft_interleaved.py``):
which engine durations make which part, worked out by hand; the benchmarks themselves run
on real vLLM and SGLang (``benchmarks/run.py ttft``, ``sglang-ttft``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import sglang_ttft  # benchmarks/ is not a package: on sys.path above
import ttft_breakdown
import ttft_interleaved


def test_a_colocated_request_in_parts() -> None:
    got = ttft_breakdown.parts(
        "colocated", 130.0, {"colocated": {"ttft": 127.0, "queue": 1.0, "prefill": 120.0}}
    )
    assert got == {"proxy + HTTP": 3.0, "API server": 6.0, "queue + prefill forward": 121.0}


def test_a_disaggregated_request_in_parts_that_sum_to_its_ttft() -> None:
    engines = {
        "prefill": {"ttft": 140.0, "queue": 2.0, "prefill": 130.0, "exposed": 1.5},
        "decode": {"ttft": 170.0, "queue": 140.0, "prefill": 25.0},
    }
    got = ttft_breakdown.parts("pd", 176.0, engines)
    assert got == {
        "proxy + HTTP": 6.0,  # 176 at the client, 170 at the decode's API server
        "API server": 5.0,  # 170 - 140 waiting - 25 first step
        "queue + prefill forward": 132.0,
        "transfer exposed": 1.5,
        "notify + schedule (residual)": 6.5,  # 140 waited - 132 - 1.5
        "decode first step": 25.0,
    }
    assert list(got) == list(ttft_breakdown.PARTS)
    assert sum(got.values()) == pytest.approx(176.0)


def test_with_the_prefill_s_first_token_the_ttft_is_the_prefill_s() -> None:
    engines = {
        "prefill": {"ttft": 127.0, "queue": 1.0, "prefill": 120.0, "exposed": 0.0},
        "decode": {"ttft": 60.0, "queue": 30.0, "prefill": 25.0},  # the second token's
    }
    got = ttft_breakdown.parts("first-token", 131.0, engines)
    assert got == {"proxy + HTTP": 4.0, "API server": 6.0, "queue + prefill forward": 121.0}


# --- SGLang (benchmarks/sglang_ttft.py) -----------------------------------------------

TTFT, QUEUE = sglang_ttft.TTFT, sglang_ttft.QUEUE


def test_a_colocated_sglang_request_in_parts() -> None:
    server = {TTFT: 540.0, QUEUE: 2.0, "request_process": 1.0, "prefill_forward": 530.0}
    got = sglang_ttft.parts(545.0, {"colocated": server})
    assert got == {
        "router + HTTP": 5.0,
        "tokenizer + detokenizer": 7.0,  # 540 - (1 + 2 + 530)
        "intake + bootstrap": 1.0,
        "queue": 2.0,
        "prefill forward": 530.0,
    }


def test_a_disaggregated_sglang_request_in_parts_that_sum_to_its_ttft() -> None:
    prefill = {
        QUEUE: 1.0,
        "prefill_bootstrap": 7.0,  # waiting for the decode's destination
        "prefill_forward": 400.0,
        "prefill_transfer_kv_cache": 2.0,
    }
    decode = {
        TTFT: 420.0,
        QUEUE: 0.5,
        "decode_prepare": 0.5,
        "decode_bootstrap": 5.0,
        "decode_transferred": 407.5,  # until the KV is in: 413 after intake, 410 sent
        "decode_waiting": 0.5,
        "fake_output": 1.5,
    }
    got = sglang_ttft.parts(431.0, {"prefill": prefill, "decode": decode})
    assert got == {
        "router + HTTP": 11.0,  # 431 at the client, 420 at the decode's tokenizer
        "tokenizer + detokenizer": 5.0,  # 420 - 415 in the decode's scheduler
        "intake + bootstrap": 7.0,
        "queue": 1.0,
        "prefill forward": 400.0,
        "transfer exposed": 2.0,
        "notify (residual)": 3.0,  # 413 - (7 + 1 + 400 + 2)
        "first output": 2.0,
    }
    assert list(got) == list(sglang_ttft.PARTS)
    assert sum(got.values()) == pytest.approx(431.0)


def test_interleaved_rounds_compare_each_request_with_colocated_s_of_the_same_round() -> None:
    colocated = [{"client_ttft_ms": v} for v in (100.0, 120.0, 110.0)]
    pair = [{"client_ttft_ms": v} for v in (105.0, 150.0, 110.0)]
    got = ttft_interleaved.paired(colocated, pair)
    assert got["ratios"] == pytest.approx([1.05, 1.25, 1.0])
    assert got["ratio_median"] == pytest.approx(1.05)
    assert got["diff_median_ms"] == pytest.approx(5.0)  # of +5, +30, 0
    assert got["within_goal"] == 2  # 1.25 is over 1.10
    assert got["rounds"] == 3
