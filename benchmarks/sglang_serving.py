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
  are recorded with the exact error instead of numbers.

Configurations (:data:`CONFIGS`): ``colocated``; ``sglang-mooncake_cpu`` and
``sglang-nixl_cpu`` (SGLang's own backends with the two CPU fixes of the test plugin
``tests/sglang_stubs/sglang_stock_cpu``); ``kvbridge-<transport>-chunk``
(``KVBRIDGE_CONFIG {"transport": ..., "layerwise": false}``) and
``kvbridge-<transport>-layer`` (``{"transport": ..., "layerwise_min_tokens": 0}``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from serving import LengthResult, fresh_dir

from kvbridge.demo.model import build_tiny_model, default_model_dir
from kvbridge.demo.servers import ServerProcess, random_prompt
from kvbridge.demo.sglang_servers import SglangRouter, SglangServer, require_sglang, stream_generate
from kvbridge.errors import KVBridgeError

PAGE = 32
START_TIMEOUT_S = 900.0
REQUEST_TIMEOUT_S = 600.0
WARM_UP_ATTEMPTS = 3


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
        Config("sglang-nixl_cpu", "nixl_cpu"),
        Config("kvbridge-nixl-chunk", "kvbridge", {"transport": "nixl", "layerwise": False}),
        Config("kvbridge-nixl-layer", "kvbridge", {"transport": "nixl", "layerwise_min_tokens": 0}),
        Config("kvbridge-mooncake-chunk", "kvbridge", {"transport": "mooncake", "layerwise": False}),
        Config("kvbridge-mooncake-layer", "kvbridge", {"transport": "mooncake", "layerwise_min_tokens": 0}),
    )
}


@dataclass
class SglangLengthResult(LengthResult):
    same: int | None = None
    """Outputs equal to the colocated server's for the same prompt (None: no reference)."""
    errors: list[str] = field(default_factory=list)
    """The failed requests' errors."""

    def summary(self) -> dict[str, Any]:
        return {**super().summary(), "same": self.same, "errors": self.errors}


class Deployment:
    """The servers (and router) of one configuration; ``url`` is what clients call."""

    def __init__(self, cfg: Config, model: Path, engine_args: list[str], logs: Path, cpus: list[list[int]]) -> None:
        self.servers: list[ServerProcess]
        if cfg.backend is None:
            self.servers = [SglangServer(model, extra_args=engine_args, log_path=logs / "colocated.log", cpus=cpus[0])]
            return
        prefill = SglangServer(
            model, extra_args=engine_args, log_path=logs / "prefill.log", mode="prefill", backend=cfg.backend,
            kvbridge_config=cfg.kvbridge, cpus=cpus[0],
        )  # fmt: skip
        decode = SglangServer(
            model, extra_args=engine_args, log_path=logs / "decode.log", mode="decode", backend=cfg.backend,
            kvbridge_config=cfg.kvbridge, cpus=cpus[-1],
        )  # fmt: skip
        assert prefill.bootstrap_port is not None
        router = SglangRouter(prefill.url, prefill.bootstrap_port, decode.url, log_path=logs / "router.log")
        self.servers = [prefill, decode, router]

    @property
    def url(self) -> str:
        return self.servers[-1].url

    def __enter__(self) -> Deployment:
        try:
            engines, router = self.servers[:2], self.servers[2:]
            for s in engines:
                s.start()
            deadline = time.monotonic() + START_TIMEOUT_S
            for s in engines:
                s.wait_ready(deadline=deadline)
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
                    stream_generate(url, random_prompt(n, seed=10_000 + 97 * n + 13 * rep + attempt), output_len, timeout=REQUEST_TIMEOUT_S)
                    break
                except (KVBridgeError, OSError) as exc:
                    log(f"warm-up request of {n} tokens failed ({str(exc)[:300]}); retrying")
                    if attempt == WARM_UP_ATTEMPTS - 1:
                        raise


def measured_prompt(n: int, i: int) -> list[int]:
    """The ``i``-th measured prompt of ``n`` tokens: the same for every configuration."""
    return random_prompt(n, seed=1_000 * n + i)


def run(
    names: list[str], lengths: list[int], prompts: int, output_len: int, shape: str, out: Path, log: Callable[[str], None]
) -> tuple[list[SglangLengthResult], dict[str, Any]]:
    require_sglang()
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        raise KVBridgeError(f"unknown configurations {unknown}", fix=f"choose from {', '.join(CONFIGS)}")
    model = build_tiny_model(default_model_dir(shape), shape=shape)
    engine_args = ["--page-size", str(PAGE), "--chunked-prefill-size", str(max(lengths) + 512)]
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
                        f"{name} {n:5d} tokens: TTFT median {_ms(s['ttft_median_ms'], 0)} ms, TPOT {_ms(s['tpot_median_ms'], 1)} ms"
                        + (f", same as colocated {r.same}/{prompts}" if r.same is not None else "")
                        + (f", {r.failed} FAILED: {r.errors[0][:300]}" if r.failed else "")
                    )
                    results.append(r)
        except (KVBridgeError, OSError) as exc:  # could not start or warm up: record why, go on
            errors[name] = dep.failure(exc)
            log(f"{name}: [red]failed[/red]: {str(exc)[:500]}")
    info = {"startup_s": started, "cpus": cpus, "shape": shape, "engine_args": engine_args, "errors": errors,
            "kvbridge_configs": {n: CONFIGS[n].kvbridge for n in names}, "title": "kvbridge SGLang serving benchmark"}  # fmt: skip
    return results, info


def measure(dep: Deployment, name: str, n: int, prompts: int, output_len: int, reference: dict[tuple[int, int], list[int]]) -> SglangLengthResult:
    """``prompts`` requests of ``n`` tokens, one at a time."""
    r = SglangLengthResult(name, n, [], [], [], 0)
    same = 0
    for i in range(prompts):
        prompt = measured_prompt(n, i)
        try:
            t = stream_generate(dep.url, prompt, output_len, timeout=REQUEST_TIMEOUT_S)
        except (KVBridgeError, OSError) as exc:
            r.failed += 1
            r.errors.append(dep.failure(exc))
            continue
        r.ttft_ms.append(t.ttft_s * 1e3)
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
    head = ["configuration"] + [f"{n} tok: TTFT / TPOT ms" for n in doc["lengths"]] + ["same tokens"]
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
            ratio = f" ({s['ttft_median_ms'] / base['ttft_median_ms']:.2f}x)" if base and base["ttft_median_ms"] and name != "colocated" else ""
            fail = f" [{s['failed']} failed]" if s["failed"] else ""
            row.append(f"{s['ttft_median_ms']:.0f}{ratio} / {_ms(s['tpot_median_ms'], 1)}{fail}")
            same += s["same"] or 0
            total += s["requests"] + s["failed"]
        row.append(f"{same}/{total}" if any(by.get(("colocated", n)) for n in doc["lengths"]) else "-")
        table.append(row)
    return head, table


def markdown(doc: dict[str, Any]) -> str:
    m = doc["machine"]
    v = m["versions"]
    head, table = rows(doc)
    lines = [
        f"Measured {m['date']} on {m['cpus']} CPUs ({m['platform']}), sglang {v.get('sglang')}, "
        f"sglang-router {v.get('sglang-router')}, nixl {v.get('nixl')}, mooncake {v.get('mooncake-transfer-engine-non-cuda')}; "
        f"model shape `{doc['shape']}`, `{' '.join(doc['engine_args'])}`; one request at a time, {doc['prompts']} "
        f"prompts per length, {doc['output_len']} output tokens; medians (ratio: TTFT / colocated TTFT).",
        "",
        "| " + " | ".join(head) + " |",
        "|---|" + "---:|" * (len(head) - 1),
    ]
    lines += ["| " + " | ".join(row) + " |" for row in table]
    for name, error in doc["errors"].items():
        lines += ["", f"`{name}` did not run:", "", "```", error.strip(), "```"]
    return "\n".join(lines) + "\n"


__all__ = ["CONFIGS", "Config", "SglangLengthResult", "markdown", "rows", "run"]
