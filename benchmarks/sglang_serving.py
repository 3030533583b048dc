"""SGLang serving benchmark: TTFT and TPOT of disaggregated SGLang (kvbridge over NIXL and
Mooncake, per chunk and per layer; SGLang's own Mooncake and NIXL backends made to run on
CPU) against one colocated SGLang server, in one run. Runs in ``.venv-sglang``.

Set-up, the same for every configuration:

- one model (the ``bench`` shape of :mod:`kvbridge.demo.model`: 8 layers), page size 32,
  ``--chunked-prefill-size`` above the longest prompt (a prompt is prefilled in one
  forward pass, so "per chunk" means one send after the whole prefill), greedy,
  ``ignore_eos``, SGLang's CPU flags (:mod:`kvbridge.demo.sglang_servers`);
- each server is pinned to its own CPU core: the colocated server and the prefill server
  on core 0, the decode server on core 1 (a core stands in for an accelerator, as in the
  vLLM serving benchmark). The router (``sglang_router`` mini_lb) and the client float;
- configurations run one after the other (only that configuration's servers are alive),
  each warmed up at every prompt length with prompts of their own, then measured one
  request at a time (concurrency 1: TTFT without queueing) on prompts that are the same
  for every configuration; the client streams ``/generate`` with token ids and times the
  first token and the rest;
- every output is compared with the colocated server's output for the same prompt
  (``same`` in the summary); a configuration that cannot start, or requests that fail,
  are recorded with the exact error instead of numbers;
- every server runs with ``--enable-metrics``; around each measured request the client
  reads the prefill server's ``sglang:per_stage_req_latency_seconds`` histogram, so each
  disaggregated request also gets SGLang's own, backend-neutral timing of its prefill
  (:data:`STAGES`): ``forward_ms`` (``prefill_forward``) and ``transfer_ms``
  (``prefill_transfer_kv_cache``: from the forward's end to the backend reporting the
  KV sent, i.e. the transfer time the prefill did not hide). TTFT minus ``forward_ms``
  (``overhead_ms``) is what disaggregation adds to the compute; unlike TTFT it does not
  carry the run-to-run noise of a 15 s CPU prefill.

Configurations (:data:`CONFIGS`): ``colocated``; ``sglang-mooncake_cpu`` and
``sglang-nixl_cpu`` (SGLang's own backends with the two CPU fixes of the test plugin
``tests/sglang_stubs/sglang_stock_cpu``); ``kvbridge-<transport>-chunk``
(``KVBRIDGE_CONFIG {"transport": ..., "layerwise": false}``) and
``kvbridge-<transport>-layer`` (``{"transport": ..., "layerwise_min_tokens": 0}``).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import requests
from prometheus_client.parser import text_string_to_metric_families
from report import md_table, measured_on
from serving import LengthResult, fresh_dir

from kvbridge.demo.model import build_tiny_model, default_model_dir
from kvbridge.demo.servers import ServerProcess, random_prompt, start_all
from kvbridge.demo.sglang_servers import SglangRouter, SglangServer, require_sglang, stream_generate
from kvbridge.errors import KVBridgeError

if TYPE_CHECKING:
    from typing_extensions import Self

PAGE = 32
START_TIMEOUT_S = 900.0
REQUEST_TIMEOUT_S = 600.0
WARM_UP_ATTEMPTS = 3
STAGE_METRIC = "sglang:per_stage_req_latency_seconds"
STAGES = {"forward_ms": "prefill_forward", "transfer_ms": "prefill_transfer_kv_cache"}
"""Per-request fields of :class:`SglangLengthResult` -> the prefill stage of SGLang's
per-stage latency histogram they come from."""


@dataclass(frozen=True)
class Config:
    name: str
    backend: str | None
    """``--disaggregation-transfer-backend``; None: colocated."""
    kvbridge: dict[str, Any] | None = None
    """``KVBRIDGE_CONFIG`` (backend ``kvbridge`` only)."""


CONFIGS: dict[str, Config] = {
    c.name: c
    for c in (
        Config("colocated", None),
        Config("sglang-mooncake_cpu", "mooncake_cpu"),
        Config(
            "kvbridge-mooncake-layer",
            "kvbridge",
            {"transport": "mooncake", "layerwise_min_tokens": 0},
        ),
        Config(
            "kvbridge-mooncake-chunk", "kvbridge", {"transport": "mooncake", "layerwise": False}
        ),
        Config("sglang-nixl_cpu", "nixl_cpu"),
        Config("kvbridge-nixl-layer", "kvbridge", {"transport": "nixl", "layerwise_min_tokens": 0}),
        Config("kvbridge-nixl-chunk", "kvbridge", {"transport": "nixl", "layerwise": False}),
    )
}


@dataclass
class SglangLengthResult(LengthResult):
    same: int | None = None
    """Outputs equal to the colocated server's for the same prompt (None: no reference)."""
    errors: list[str] = field(default_factory=list)
    """The failed requests' errors."""
    forward_ms: list[float] = field(default_factory=list)
    """Per request: SGLang's ``prefill_forward`` stage on the prefill (disaggregated only)."""
    transfer_ms: list[float] = field(default_factory=list)
    """Per request: SGLang's ``prefill_transfer_kv_cache`` stage (forward end -> KV sent)."""
    overhead_ms: list[float] = field(default_factory=list)
    """Per request: TTFT minus ``forward_ms``."""

    def summary(self) -> dict[str, Any]:
        def med(xs: list[float]) -> float | None:
            return statistics.median(xs) if xs else None

        return {
            **super().summary(),
            "same": self.same,
            "errors": self.errors,
            "forward_median_ms": med(self.forward_ms),
            "transfer_median_ms": med(self.transfer_ms),
            "overhead_median_ms": med(self.overhead_ms),
        }


def stage_totals(url: str, histograms: tuple[str, ...] = ()) -> dict[str, tuple[float, float]]:
    """``{stage: (sum of seconds, count)}`` of the per-stage latency histogram that an SGLang
    server started with ``--enable-metrics`` serves at ``/metrics``, and the same under
    their own names for the other histograms named in ``histograms`` (label sets summed)."""
    resp = requests.get(f"{url}/metrics", timeout=10)
    resp.raise_for_status()
    totals: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(resp.text):
        if family.name != STAGE_METRIC and family.name not in histograms:
            continue
        for sample in family.samples:
            key = sample.labels.get("stage") if family.name == STAGE_METRIC else family.name
            if key is None or not sample.name.endswith(("_sum", "_count")):
                continue
            t = totals.setdefault(key, [0.0, 0.0])
            t[sample.name.endswith("_count")] += sample.value
    return {k: (v[0], v[1]) for k, v in totals.items()}


def stage_ms(
    before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]], stage: str
) -> float | None:
    """The one observation of ``stage`` between two :func:`stage_totals`, in ms; None
    unless exactly one request went through that stage in between."""
    s0, c0 = before.get(stage, (0.0, 0.0))
    s1, c1 = after.get(stage, (0.0, 0.0))
    return (s1 - s0) * 1e3 if c1 - c0 == 1 else None


class Deployment:
    """The servers (and router) of one configuration; ``url`` is what clients call."""

    def __init__(
        self, cfg: Config, model: Path, engine_args: list[str], logs: Path, cpus: list[list[int]]
    ) -> None:
        self.servers: list[ServerProcess]
        if cfg.backend is None:
            self.servers = [
                SglangServer(
                    model, extra_args=engine_args, log_path=logs / "colocated.log", cpus=cpus[0]
                )
            ]
            return
        prefill = SglangServer(
            model,
            extra_args=engine_args,
            log_path=logs / "prefill.log",
            mode="prefill",
            backend=cfg.backend,
            kvbridge_config=cfg.kvbridge,
            cpus=cpus[0],
        )
        decode = SglangServer(
            model,
            extra_args=engine_args,
            log_path=logs / "decode.log",
            mode="decode",
            backend=cfg.backend,
            kvbridge_config=cfg.kvbridge,
            cpus=cpus[-1],
        )
        assert prefill.bootstrap_port is not None
        router = SglangRouter(
            prefill.url, prefill.bootstrap_port, decode.url, log_path=logs / "router.log"
        )
        self.servers = [prefill, decode, router]

    @property
    def url(self) -> str:
        return self.servers[-1].url

    @property
    def prefill_url(self) -> str | None:
        """The prefill server's URL (its ``/metrics``); None when colocated."""
        return self.servers[0].url if len(self.servers) > 1 else None

    def __enter__(self) -> Self:
        try:
            engines, router = self.servers[:2], self.servers[2:]
            start_all(engines, START_TIMEOUT_S)
            for s in router:
                s.start().wait_ready(60)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for s in reversed(self.servers):
            s.stop()

    def failure(self, exc: BaseException) -> str:
        """``exc`` and the last lines of every server's log (the cause is often there)."""
        tails = "".join(f"\n--- {s.log_path.name} ---\n{s.log_tail(15)}" for s in self.servers)
        return f"{type(exc).__name__}: {exc}{tails}"


def warm_up(url: str, lengths: list[int], output_len: int, log: Callable[[str], None]) -> None:
    """Two requests per length, prompts nobody measures (first contacts, handshakes, new
    shapes); a failing one is retried."""
    for n in lengths:
        for rep in range(2):
            for attempt in range(WARM_UP_ATTEMPTS):
                try:
                    stream_generate(
                        url,
                        random_prompt(n, seed=10_000 + 97 * n + 13 * rep + attempt),
                        output_len,
                        timeout=REQUEST_TIMEOUT_S,
                    )
                    break
                except (KVBridgeError, OSError) as exc:
                    log(f"warm-up request of {n} tokens failed ({str(exc)[:300]}); retrying")
                    if attempt == WARM_UP_ATTEMPTS - 1:
                        raise


def measured_prompt(n: int, i: int) -> list[int]:
    """The ``i``-th measured prompt of ``n`` tokens: the same for every configuration."""
    return random_prompt(n, seed=1_000 * n + i)


def run(
    names: list[str],
    lengths: list[int],
    prompts: int,
    output_len: int,
    shape: str,
    out: Path,
    log: Callable[[str], None],
) -> tuple[list[SglangLengthResult], dict[str, Any]]:
    require_sglang()
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        raise KVBridgeError(
            f"unknown configurations {unknown}", fix=f"choose from {', '.join(CONFIGS)}"
        )
    model = build_tiny_model(default_model_dir(shape), shape=shape)
    engine_args = [
        "--page-size",
        str(PAGE),
        "--chunked-prefill-size",
        str(max(lengths) + 512),
        "--enable-metrics",
    ]
    cpus = [[0], [1]] if len(os.sched_getaffinity(0)) >= 2 else [[0]]
    raw = out / "sglang-raw"
    raw.mkdir(parents=True, exist_ok=True)
    results: list[SglangLengthResult] = []
    started: dict[str, float] = {}
    errors: dict[str, str] = {}
    reference: dict[tuple[int, int], list[int]] = {}  # (length, i) -> colocated output
    for name in names:
        cfg = CONFIGS[name]
        logs = fresh_dir(raw / name)
        log(f"{name}: starting")
        t0 = time.monotonic()
        dep = Deployment(cfg, model, engine_args, logs, cpus)
        try:
            with dep:
                started[name] = time.monotonic() - t0
                log(f"{name}: up in {started[name]:.0f} s; warming up")
                warm_up(dep.url, lengths, output_len, log)
                for n in lengths:
                    r = measure(dep, name, n, prompts, output_len, reference)
                    s = r.summary()
                    log(
                        f"{name} {n:5d} tokens: TTFT median {_ms(s['ttft_median_ms'], 0)} ms, TPOT "
                        f"{_ms(s['tpot_median_ms'], 1)} ms"
                        + (
                            f", transfer after forward {_ms(s['transfer_median_ms'], 1)} ms"
                            if r.transfer_ms
                            else ""
                        )
                        + (f", same as colocated {r.same}/{prompts}" if r.same is not None else "")
                        + (f", {r.failed} FAILED: {r.errors[0][:300]}" if r.failed else "")
                    )
                    results.append(r)
        except (KVBridgeError, OSError) as exc:  # could not start or warm up: record why, go on
            errors[name] = dep.failure(exc)
            log(f"{name}: [red]failed[/red]: {str(exc)[:500]}")
    info = {
        "startup_s": started,
        "cpus": cpus,
        "shape": shape,
        "engine_args": engine_args,
        "errors": errors,
        "kvbridge_configs": {n: CONFIGS[n].kvbridge for n in names},
        "title": "kvbridge SGLang serving benchmark",
    }
    return results, info


def measure(
    dep: Deployment,
    name: str,
    n: int,
    prompts: int,
    output_len: int,
    reference: dict[tuple[int, int], list[int]],
) -> SglangLengthResult:
    """``prompts`` requests of ``n`` tokens, one at a time."""
    r = SglangLengthResult(name, n, [], [], [], 0)
    same = 0
    for i in range(prompts):
        prompt = measured_prompt(n, i)
        try:
            before = stage_totals(dep.prefill_url) if dep.prefill_url else {}
            t = stream_generate(dep.url, prompt, output_len, timeout=REQUEST_TIMEOUT_S)
            after = stage_totals(dep.prefill_url) if dep.prefill_url else {}
        except (KVBridgeError, OSError) as exc:  # requests' errors are OSErrors
            r.failed += 1
            r.errors.append(dep.failure(exc))
            continue
        r.ttft_ms.append(t.ttft_s * 1e3)
        forward, transfer = (
            stage_ms(before, after, STAGES[k]) for k in ("forward_ms", "transfer_ms")
        )
        if forward is not None and transfer is not None:
            r.forward_ms.append(forward)
            r.transfer_ms.append(transfer)
            r.overhead_ms.append(t.ttft_s * 1e3 - forward)
        if len(t.token_ids) > 1:
            r.tpot_ms.append(t.tpot_s * 1e3)
        r.input_lens.append(n)
        if name == "colocated":
            reference[(n, i)] = t.token_ids
        same += reference.get((n, i)) == t.token_ids
    if any(k[0] == n for k in reference):
        r.same = same
    return r


def _ms(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def rows(doc: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """One row per configuration, one column per prompt length: ``TTFT (x colocated) /
    TPOT`` in ms (medians), then how many outputs equal the colocated ones."""
    by = {(s["config"], s["prompt_tokens"]): s for s in doc["summary"]}
    head = (
        ["configuration"] + [f"{n} tok: TTFT / TPOT ms" for n in doc["lengths"]] + ["same tokens"]
    )
    table = []
    for name in doc["configs"]:
        if name in doc["errors"]:
            first = doc["errors"][name].splitlines()[0][:120]
            table.append([name] + ["-"] * len(doc["lengths"]) + [f"did not run: {first}"])
            continue
        row, same, total = [name], 0, 0
        for n in doc["lengths"]:
            s = by.get((name, n))
            if s is None or s["ttft_median_ms"] is None:
                row.append(f"all {s['failed']} failed" if s else "-")
                continue
            base = by.get(("colocated", n))
            ratio = (
                f" ({s['ttft_median_ms'] / base['ttft_median_ms']:.2f}x)"
                if base and base["ttft_median_ms"] and name != "colocated"
                else ""
            )
            fail = f" [{s['failed']} failed]" if s["failed"] else ""
            row.append(f"{s['ttft_median_ms']:.0f}{ratio} / {_ms(s['tpot_median_ms'], 1)}{fail}")
            same += s["same"] or 0
            total += s["requests"] + s["failed"]
        row.append(
            f"{same}/{total}" if any(by.get(("colocated", n)) for n in doc["lengths"]) else "-"
        )
        table.append(row)
    return head, table


def stage_rows(doc: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """One row per disaggregated configuration, one column per prompt length: SGLang's
    ``transfer_ms / overhead_ms`` medians (see the module docstring)."""
    by = {(s["config"], s["prompt_tokens"]): s for s in doc["summary"]}
    head = ["configuration"] + [f"{n} tok: transfer / overhead ms" for n in doc["lengths"]]
    table = []
    for name in doc["configs"]:
        stats = [by.get((name, n)) for n in doc["lengths"]]
        if not any(s and s.get("transfer_median_ms") is not None for s in stats):
            continue
        table.append(
            [name]
            + [
                f"{_ms(s.get('transfer_median_ms'), 1)} / {_ms(s.get('overhead_median_ms'), 0)}"
                if s
                else "-"
                for s in stats
            ]
        )
    return head, table


def markdown(doc: dict[str, Any]) -> str:
    m = doc["machine"]
    v = m["versions"]
    head, table = rows(doc)
    lines = [
        (
            f"{measured_on(m)}, sglang "
            f"{v.get('sglang')}, sglang-router {v.get('sglang-router')}, nixl {v.get('nixl')}, "
            f"mooncake {v.get('mooncake-transfer-engine-non-cuda')}; model shape `{doc['shape']}`, "
            f"`{' '.join(doc['engine_args'])}`; one request at a time, {doc['prompts']} prompts "
            f"per length, {doc['output_len']} output tokens; medians (ratio: TTFT / colocated "
            "TTFT)."
        ),
        "",
        *md_table(head, table),
    ]
    head, table = stage_rows(doc)
    if table:
        lines += [
            "",
            (
                "SGLang's own timing of each request on the prefill server (`--enable-metrics`, "
                f"`{STAGE_METRIC}`), medians: *transfer* = stage `{STAGES['transfer_ms']}` (the "
                "forward's end to the backend reporting the KV sent: the transfer time the prefill "
                f"did not hide), *overhead* = TTFT minus stage `{STAGES['forward_ms']}` (what "
                "disaggregation adds to the prefill's compute: bootstrap, transfer, hand-over, "
                "the decode's first step, the router)."
            ),
            "",
            *md_table(head, table),
        ]
    for name, error in doc["errors"].items():
        lines += ["", f"`{name}` did not run:", "", "```", error.strip(), "```"]
    return "\n".join(lines) + "\n"


__all__ = [
    "CONFIGS",
    "STAGES",
    "Config",
    "SglangLengthResult",
    "markdown",
    "rows",
    "run",
    "stage_rows",
    "stage_totals",
]
