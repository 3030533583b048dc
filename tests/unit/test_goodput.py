"""The goodput benchmark's arithmetic (``benchmarks/goodput.py``): percentiles, TPOT,
goodput against two objectives, the objectives from an unloaded run, the request mix and
the split of a decode's token gaps around arriving requests. Expected values are worked
out by hand on small inputs; the benchmark itself runs on real vLLM
(``benchmarks/run.py goodput``)."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import goodput  # benchmarks/ is not a package: on sys.path above
from goodput import Objectives


def bench_doc(rows: list[tuple[float, float, int, int, str]], duration: float) -> dict:
    """A ``vllm bench serve`` detailed document from (ttft s, latency s, input tokens,
    output tokens, error) per request; a failed request has zeros and an error."""
    return {
        "ttfts": [r[0] for r in rows],
        "latencies": [r[1] for r in rows],
        "input_lens": [r[2] for r in rows],
        "output_lens": [r[3] for r in rows],
        "errors": [r[4] for r in rows],
        "start_times": [float(i) for i in range(len(rows))],
        "duration": duration,
    }


def test_percentile_interpolates_between_closest_ranks() -> None:
    values = [4.0, 1.0, 3.0, 2.0]  # order must not matter
    assert goodput.percentile(values, 50) == pytest.approx(2.5)  # halfway between 2 and 3
    # rank (4 - 1) * 0.99 = 2.97: 3 + 0.97 * (4 - 3)
    assert goodput.percentile(values, 99) == pytest.approx(3.97)
    assert goodput.percentile(values, 0) == 1.0
    assert goodput.percentile(values, 100) == 4.0
    assert goodput.percentile([7.0], 99) == 7.0
    assert goodput.percentile([], 50) is None


def test_tpot_is_time_after_the_first_token_per_later_token() -> None:
    # 11 tokens: the first at 0.1 s, the last at 1.1 s -> 10 gaps of 0.1 s
    assert goodput.request_tpot(0.1, 1.1, 11) == pytest.approx(0.1)
    assert goodput.request_tpot(0.3, 0.3, 1) == 0.0


def test_summary_counts_a_request_good_only_when_it_meets_both_objectives() -> None:
    doc = bench_doc(
        [
            (0.1, 1.1, 50, 11, ""),  # TTFT 100 ms, TPOT 100 ms
            (0.5, 0.9, 50, 5, ""),  # TTFT 500 ms, TPOT 100 ms
            (0.2, 3.2, 50, 11, ""),  # TTFT 200 ms, TPOT 300 ms
            (0.0, 0.0, 50, 0, "boom"),  # failed
        ],
        duration=2.0,
    )
    s = goodput.summarize(doc, Objectives(ttft_ms=400, tpot_ms=150))
    assert (s["requests"], s["completed"], s["failed"]) == (4, 3, 1)
    assert s["goodput"] == pytest.approx(0.5)  # only the first, over 2 s
    assert s["good_share"] == pytest.approx(0.25)
    assert s["req_per_s"] == pytest.approx(1.5)
    assert s["out_tok_per_s"] == pytest.approx((11 + 5 + 11) / 2)
    assert s["ttft_p50_ms"] == pytest.approx(200)  # of 100, 200, 500
    assert s["tpot_p50_ms"] == pytest.approx(100)  # of 100, 100, 300
    # an objective met exactly counts: TTFT 500 <= 500 and TPOT 100 <= 100
    assert goodput.summarize(doc, Objectives(500, 100))["goodput"] == pytest.approx(1.0)
    # the failed request never counts, however loose the objectives
    assert goodput.summarize(doc, Objectives(1e9, 1e9))["goodput"] == pytest.approx(1.5)


def test_objectives_scale_the_longest_prompts_ttft_and_the_median_tpot() -> None:
    doc = bench_doc(
        [
            (0.1, 0.1 + 10 * 0.02, 50, 11, ""),  # TPOT 20 ms
            (0.1, 0.1 + 10 * 0.03, 50, 11, ""),  # TPOT 30 ms
            (0.4, 0.4 + 10 * 0.02, 300, 11, ""),  # TPOT 20 ms, longest prompt
            (0.6, 0.6 + 10 * 0.04, 300, 11, ""),  # TPOT 40 ms, longest prompt
        ],
        duration=5.0,
    )
    slo = goodput.objectives(doc)
    # TTFT of the 300-token prompts: median of 400 and 600 ms; TPOT: median of 20, 20,
    # 30, 40 ms
    assert slo.ttft_ms == pytest.approx(goodput.TTFT_FACTOR * 500, abs=0.1)
    assert slo.tpot_ms == pytest.approx(goodput.TPOT_FACTOR * 25, abs=0.1)


def test_mix_is_mostly_short_some_long_and_the_same_for_a_seed() -> None:
    specs = goodput.mix(2000, seed=1, short=(10, 20), long=(100, 200), long_share=0.1)
    assert specs == goodput.mix(2000, seed=1, short=(10, 20), long=(100, 200), long_share=0.1)
    assert specs != goodput.mix(2000, seed=2, short=(10, 20), long=(100, 200), long_share=0.1)
    longs = [s for s in specs if s.long]
    # binomial(2000, 0.1): 200 +- 13 (one standard deviation); 3 of them either side
    assert 160 <= len(longs) <= 240
    assert all(100 <= s.prompt_words <= 200 for s in longs)
    assert all(10 <= s.prompt_words <= 20 for s in specs if not s.long)
    assert {s.prompt_words for s in specs if not s.long} == set(range(10, 21))  # inclusive
    assert all(goodput.OUTPUT[0] <= s.output_tokens <= goodput.OUTPUT[1] for s in specs)
    assert {s.prompt_words for s in goodput.mix(50, 3, short=(7, 7), long_share=0.0)} == {7}
    assert all(s.long for s in goodput.mix(50, 3, long=(9, 9), long_share=1.0))


def test_prompts_are_made_of_single_token_words() -> None:
    vocab = ["Ġthe", "Ġcat", "the", "Ġ3d", "ĠThe", "Ġa", "<s>", "Ġcafé", "Ġs-t"]
    # "Ġa" is one letter; "the" has no space; the others are not lowercase ASCII letters
    assert goodput.single_token_words(vocab) == [" cat", " the"]
    text = goodput.prompt_text(5, [" x", " y"], random.Random(0))
    # five words of two characters each: a space, then x or y
    assert len(text) == 10 and text[::2] == " " * 5 and set(text[1::2]) <= {"x", "y"}
    # every word keeps its space, the first too (a bare first word is other tokens)
    assert goodput.prompt_text(3, [" x"], random.Random(0)) == " x x x"


def test_dataset_lines_carry_prompt_and_output_tokens(tmp_path: Path) -> None:
    specs = [goodput.Spec(3, 16, False), goodput.Spec(4, 20, True)]
    path = tmp_path / "mix.jsonl"
    prompts = goodput.write_dataset(path, specs, [" z"], seed=0)
    assert prompts == [" z z z", " z z z z"]
    assert path.read_text().splitlines() == [
        '{"prompt": " z z z", "output_tokens": 16}',
        '{"prompt": " z z z z", "output_tokens": 20}',
    ]


def test_gaps_split_around_arrivals() -> None:
    times = [0.0, 1.0, 3.0, 6.0, 10.0, 15.0]  # gaps 1, 2, 3, 4, 5
    # answered at 3.2: nearest token at 3.0 -> the gaps 1->3 and 3->6 are that step's;
    # 0->1 overlaps the window; 6->10 and 10->15 do not
    assert goodput.split_gaps(times, [(0.5, 3.2)]) == {
        "joined": [2.0, 3.0],
        "during": [1.0],
        "outside": [4.0, 5.0],
    }
    # a second arrival answered at 12: nearest token at 10 -> gaps 6->10 and 10->15
    assert goodput.split_gaps(times, [(0.5, 3.2), (11.0, 12.0)]) == {
        "joined": [2.0, 3.0, 4.0, 5.0],
        "during": [1.0],
        "outside": [],
    }
    assert goodput.split_gaps(times, []) == {
        "joined": [],
        "during": [],
        "outside": [1.0, 2.0, 3.0, 4.0, 5.0],
    }


def test_arrival_ratios_compare_each_repetition_with_its_own_alone_run() -> None:
    reps = [
        {"alone": [0.02, 0.02], "with": [0.02, 0.04], "during": [0.03], "windows": [(0, 1)]},
        {"alone": [0.01, 0.01], "with": [0.01, 0.01], "during": [], "windows": []},
    ]
    r = goodput.arrival_ratios(reps)
    assert r["alone_tpot_ms"] == pytest.approx([20, 10])
    assert r["with_arrivals_tpot_ms"] == pytest.approx([30, 10])
    assert r["ratio_all"] == pytest.approx([1.5, 1.0])
    assert r["ratio_all_median"] == pytest.approx(1.25)
    assert r["ratio_kv_only"] == pytest.approx([1.5])  # the second had no arrival
    assert r["alone_spread"] == pytest.approx(2.0)
    assert r["arrivals"] == [1, 0]
