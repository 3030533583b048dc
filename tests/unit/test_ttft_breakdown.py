"""The TTFT breakdown's arithmetic (``benchmarks/ttft_breakdown.py``): which engine
durations make which part, worked out by hand; the benchmark itself runs on real vLLM
(``benchmarks/run.py ttft``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import ttft_breakdown  # benchmarks/ is not a package: on sys.path above


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
