"""Where a short prompt's time to first token goes on SGLang: one request at a time,
colocated SGLang against a prefill/decode pair behind SGLang's router, each request's
time cut into parts. Runs in ``.venv-sglang``; the SGLang counterpart of
:mod:`ttft_breakdown` (same report shape).

The parts come from SGLang's own per-request timing (``--enable-metrics``), read as the
change of its Prometheus histograms over one request (one request in flight, so each
histogram's sum moves by that request's value), and from the client's clock:

- at each server: ``time_to_first_token`` (its tokenizer's arrival to first token out),
  ``queue_time`` (waiting queue to the first forward) and the per-stage histogram
  ``sglang:per_stage_req_latency_seconds`` (the stages of SGLang's
  ``observability/req_time_stats.py``): colocated ``request_process``,
  ``prefill_forward``; the prefill's ``prefill_bootstrap`` (until the backend has the
  decode's destination: SGLang starts no forward before it; its ``prefill_prepare``, the
  intake before it, is not exported), ``prefill_forward``, ``prefill_transfer_kv_cache``
  (forward done to the backend reporting the KV sent); the decode's ``decode_prepare``,
  ``decode_bootstrap`` (the handshake with the prefill, its pages allocated),
  ``decode_transferred`` (until the backend reports the KV in), ``decode_waiting`` and
  ``fake_output`` (the first token, which the prefill computed, put out without a
  forward);
- at the client: TTFT through the router (the pair) or straight to the server.

Parts of the pair's TTFT, which add up to it by construction:

- ``router + HTTP``: the client's TTFT less the decode server's (the router's hop both
  ways, the first event back through it);
- ``tokenizer + detokenizer``: the decode server's TTFT less its scheduler's stages
  (tokenisation, hand-over to the scheduler, the first output back out);
- ``intake + bootstrap``: the prefill's ``prefill_bootstrap``: until the prefill can
  compute, which is until the decode has allocated and sent its destination (the
  decode's own ``decode_prepare`` + ``decode_bootstrap`` are in the JSON);
- ``queue``, ``prefill forward``, ``transfer exposed``: the prefill's;
- ``notify (residual)``: the rest of the decode's wait (its intake, bootstrap and
  transfer wait less the prefill's bootstrap to KV sent): the completion reaching the
  decode and the decode's scheduler polling it, the prefill's unexported intake, less how
  much later the decode's scheduler got the request than the prefill's (durations, not
  times: these cannot be told apart);
- ``first output``: the decode's ``decode_waiting`` + ``fake_output``.

Colocated: ``HTTP``, ``tokenizer + detokenizer``, ``intake`` (``request_process``),
``queue``, ``prefill forward`` (its output step included, which the pair's prefill runs
too before it reports the forward done).

Set-up as :mod:`sglang_serving` (the ``bench`` model, page 32, pinned cores: colocated and
prefill on core 0, decode on core 1; router and client float).
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from report import md_report, measured_on
from serving import fresh_dir
from sglang_serving import CONFIGS as SERVING_CONFIGS
from sglang_serving import PAGE, REQUEST_TIMEOUT_S, Deployment, stage_totals, warm_up
from ttft_breakdown import rows, summarize

from kvbridge.demo.model import build_tiny_model, default_model_dir
from kvbridge.demo.servers import random_prompt
from kvbridge.demo.sglang_servers import require_sglang, stream_generate

CONFIGS = (
    "colocated",
    "sglang-mooncake_cpu",
    "kvbridge-nixl-layer",
    "kvbridge-mooncake-layer",
    "kvbridge-nixl-chunk",
    "kvbridge-mooncake-chunk",
)
"""The default rows: colocated, SGLang's own Mooncake backend (the reference a user
switches from), kvbridge per layer and per chunk on both transports."""

PARTS = (
    "router + HTTP",
    "tokenizer + detokenizer",
    "intake + bootstrap",
    "queue",
    "prefill forward",
    "transfer exposed",
    "notify (residual)",
    "first output",
)
"""A request's TTFT in parts (module docstring); colocated has the first five."""

TTFT, QUEUE = "sglang:time_to_first_token_seconds", "sglang:queue_time_seconds"
HISTOGRAMS = (TTFT, QUEUE)
STAGES = {
    "colocated": ("request_process", "prefill_forward"),
    "prefill": (
        "prefill_bootstrap",
        "prefill_forward",
        "prefill_transfer_kv_cache",
    ),
    "decode": (
        "decode_prepare",
        "decode_bootstrap",
        "decode_transferred",
        "decode_waiting",
        "fake_output",
    ),
}
"""Per server role: the per-stage histogram's stages each request passes through."""


def _one(
    url: str,
    before: dict[str, tuple[float, float]],
    keys: tuple[str, ...],
    timeout: float = 30,
) -> dict[str, float]:
    """One server's value of each of ``keys`` (stages, histograms) for the one request it
    served since ``before``, in ms, once every one counted it (polled: SGLang observes
    some stages after the client's stream ended, in another process)."""
    deadline = time.monotonic() + timeout
    while True:
        now = stage_totals(url, HISTOGRAMS)
        counted = [now.get(k, (0, 0))[1] - before.get(k, (0, 0))[1] for k in keys]
        if all(c >= 1 for c in counted):
            if any(c > 1 for c in counted):
                raise RuntimeError(f"{url} served more than the one traced request")
            return {k: 1e3 * (now[k][0] - before.get(k, (0.0, 0))[0]) for k in keys}
        if time.monotonic() > deadline:
            missing = [k for k, c in zip(keys, counted, strict=True) if c < 1]
            raise RuntimeError(f"{url} did not count the traced request in {missing}")
        time.sleep(0.05)


def parts(client_ms: float, servers: dict[str, dict[str, float]]) -> dict[str, float]:
    """One request's TTFT in :data:`PARTS` (module docstring); they sum to ``client_ms``.
    ``servers``: per role (``colocated``, or ``prefill`` and ``decode``) the :func:`_one`
    values."""
    if "colocated" in servers:
        c = servers["colocated"]
        stages = c["request_process"] + c[QUEUE] + c["prefill_forward"]
        return {
            "router + HTTP": client_ms - c[TTFT],
            "tokenizer + detokenizer": c[TTFT] - stages,
            "intake + bootstrap": c["request_process"],
            "queue": c[QUEUE],
            "prefill forward": c["prefill_forward"],
        }
    p, d = servers["prefill"], servers["decode"]
    d_stages = sum(d[s] for s in STAGES["decode"])
    intake = p["prefill_bootstrap"]
    kv_sent = intake + p[QUEUE] + p["prefill_forward"] + p["prefill_transfer_kv_cache"]
    kv_seen = d["decode_prepare"] + d["decode_bootstrap"] + d["decode_transferred"]
    return {
        "router + HTTP": client_ms - d[TTFT],
        "tokenizer + detokenizer": d[TTFT] - d_stages,
        "intake + bootstrap": intake,
        "queue": p[QUEUE],
        "prefill forward": p["prefill_forward"],
        "transfer exposed": p["prefill_transfer_kv_cache"],
        "notify (residual)": kv_seen - kv_sent,
        "first output": d["decode_waiting"] + d["fake_output"],
    }


def run(
    names: list[str],
    length: int,
    requests: int,
    output_len: int,
    shape: str,
    out: Path,
    log: Callable[[str], None],
    transports: tuple[str, ...] = ("nixl", "mooncake"),
    pairs: int = 25,
) -> dict[str, Any]:
    """The configurations ``names`` one after the other, ``requests`` requests each, then
    :func:`layer_vs_chunk` over each of ``transports`` with ``pairs`` pairs."""
    require_sglang()
    model = build_tiny_model(default_model_dir(shape), shape=shape)
    engine_args = [
        "--page-size",
        str(PAGE),
        "--chunked-prefill-size",
        str(length + 512),
        "--enable-metrics",
    ]
    cpus = [[0], [1]] if len(os.sched_getaffinity(0)) >= 2 else [[0]]
    raw = out / "sglang-ttft-raw"
    result: dict[str, Any] = {
        "length": length,
        "output_len": output_len,
        "shape": shape,
        "engine_args": engine_args,
        "parts": list(PARTS),
        "configs": {},
    }
    for name in names:
        cfg = SERVING_CONFIGS[name]
        logs = fresh_dir(raw / name)
        log(f"{name}: starting")
        with Deployment(cfg, model, engine_args, logs, cpus) as dep:
            warm_up(dep.url, [length], output_len, log)
            roles = (
                {"colocated": dep.servers[0].url}
                if dep.prefill_url is None
                else {"prefill": dep.servers[0].url, "decode": dep.servers[1].url}
            )
            # the prefill's tokenizer streams no token to anyone: no TTFT of its own
            keys = {r: (*STAGES[r], QUEUE, *(() if r == "prefill" else (TTFT,))) for r in roles}
            rows = []
            for i in range(requests):
                prompt = random_prompt(length, seed=60_000 + i)  # the same for every config
                before = {role: stage_totals(url, HISTOGRAMS) for role, url in roles.items()}
                timing = stream_generate(dep.url, prompt, output_len, timeout=REQUEST_TIMEOUT_S)
                servers = {r: _one(url, before[r], keys[r]) for r, url in roles.items()}
                client_ms = 1e3 * timing.ttft_s
                rows.append(
                    {
                        "client_ttft_ms": client_ms,
                        "client_tpot_ms": 1e3 * timing.tpot_s,
                        "client_second_ms": 1e3 * (timing.second_s or 0.0),
                        "token_ids": timing.token_ids,
                        "servers": servers,
                        "parts": parts(client_ms, servers),
                    }
                )
        result["configs"][name] = summarize(name, rows, log)
    ref = result["configs"].get("colocated")
    if ref is not None:  # the same prompts everywhere: outputs comparable token for token
        for c in result["configs"].values():
            c["same"] = sum(
                a["token_ids"] == b["token_ids"]
                for a, b in zip(c["requests"], ref["requests"], strict=True)
            )
    result["layer_vs_chunk"] = {
        t: layer_vs_chunk(t, length, pairs, output_len, model, engine_args, cpus, raw, log)
        for t in transports
    }
    return result


def layer_vs_chunk(
    transport: str,
    length: int,
    pairs: int,
    output_len: int,
    model: Path,
    engine_args: list[str],
    cpus: list[list[int]],
    raw: Path,
    log: Callable[[str], None],
) -> dict[str, Any]:
    """What the per-layer path costs or saves against the per-chunk one, without the
    noise of comparing deployments run minutes apart: one deployment with
    ``layerwise_min_tokens: length``, ``pairs`` pairs of prompts of ``length`` tokens
    (per layer) and ``length - 1`` (per chunk; one token less compute) in alternating
    order. Per pair: the prefill's ``prefill_forward`` and the client's TTFT, per layer
    minus per chunk."""
    cfg = dataclasses.replace(
        SERVING_CONFIGS[f"kvbridge-{transport}-layer"],
        kvbridge={"transport": transport, "layerwise_min_tokens": length},
    )
    lengths = (length - 1, length)
    got: dict[int, dict[str, list[float]]] = {n: {"forward": [], "ttft": []} for n in lengths}
    log(f"per layer vs per chunk over {transport}: starting")
    with Deployment(cfg, model, engine_args, fresh_dir(raw / f"ab-{transport}"), cpus) as dep:
        warm_up(dep.url, list(lengths), output_len, log)
        prefill = dep.servers[0].url
        for i in range(pairs):
            for n in lengths if i % 2 == 0 else lengths[::-1]:
                before = stage_totals(prefill)
                t = stream_generate(
                    dep.url,
                    random_prompt(n, seed=61_000 + 2 * i + length - n),
                    output_len,
                    timeout=REQUEST_TIMEOUT_S,
                )
                forward = _one(prefill, before, ("prefill_forward",))["prefill_forward"]
                got[n]["forward"].append(forward)
                got[n]["ttft"].append(1e3 * t.ttft_s)
    diff = {
        k: [b - a for a, b in zip(got[length - 1][k], got[length][k], strict=True)]
        for k in ("forward", "ttft")
    }
    out = {
        "length": length,
        "pairs": pairs,
        "samples": {str(n): v for n, v in got.items()},
        **{f"{k}_diff_median_ms": statistics.median(v) for k, v in diff.items()},
        "forward_slower_pairs": sum(d > 0 for d in diff["forward"]),
    }
    log(
        f"per layer vs per chunk over {transport}: forward {out['forward_diff_median_ms']:+.1f} "
        f"ms, TTFT {out['ttft_diff_median_ms']:+.1f} ms (medians of {pairs} pairs)"
    )
    return out


def ab_rows(doc: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """The per-layer vs per-chunk table (:func:`layer_vs_chunk`), one row per transport."""
    head = [
        "transport",
        "pairs",
        "forward, per layer - per chunk (ms)",
        "pairs whose forward was slower per layer",
        "TTFT, per layer - per chunk (ms)",
    ]
    body = [
        [
            t,
            str(r["pairs"]),
            f"{r['forward_diff_median_ms']:+.1f}",
            f"{r['forward_slower_pairs']}/{r['pairs']}",
            f"{r['ttft_diff_median_ms']:+.1f}",
        ]
        for t, r in doc.get("layer_vs_chunk", {}).items()
    ]
    return head, body


def markdown(doc: dict[str, Any]) -> str:
    m = doc["machine"]
    head, body = rows(doc)
    if all("same" in c for c in doc["configs"].values()):
        n = len(next(iter(doc["configs"].values()))["requests"])
        body.append(
            ["same tokens as colocated", *(f"{c['same']}/{n}" for c in doc["configs"].values())]
        )
    intro = (
        f"{measured_on(m)}, sglang {m['versions'].get('sglang')}, sglang-router "
        f"{m['versions'].get('sglang-router')}: model shape `{doc['shape']}`, "
        f"`{' '.join(doc['engine_args'])}`, prompts of {doc['length']} tokens, "
        f"{doc['output_len']} output tokens, one request at a time, greedy; the parts of the "
        "request whose TTFT is the median (`benchmarks/sglang_ttft.py` says where each part "
        "comes from)."
    )
    text = md_report(intro, head, body)
    head, body = ab_rows(doc)
    if body:
        n = next(iter(doc["layer_vs_chunk"].values()))["length"]
        text += "\n" + md_report(
            (
                f"Per layer against per chunk, interleaved in one deployment per transport "
                f"(`layerwise_min_tokens: {n}`): prompts of {n} tokens (per layer) and "
                f"{n - 1} (per chunk) in alternating order; medians of the per-pair "
                "differences of the prefill's `prefill_forward` and the client's TTFT."
            ),
            head,
            body,
        )
    return text


__all__ = ["CONFIGS", "PARTS", "markdown", "parts", "run"]
