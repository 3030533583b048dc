"""The ``kvbridge`` command.

kvbridge doctor [--json] [--transport NAME ...] [--config JSON]
                                                  which transports work here, and fixes
kvbridge config [JSON | @FILE] [--json]           validate a config; print the effective one
kvbridge proxy --prefill URL --decode URL [--port N] [--flow push|pull|sequential]
                                                  OpenAI-compatible prefill/decode proxy
kvbridge demo [--engine vllm|sglang] [--transport nixl|mooncake]
                                                  P/D disaggregation on this machine
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

import msgspec
from rich.console import Console
from rich.table import Table

from kvbridge import __version__


def _doctor(args: argparse.Namespace) -> int:
    from kvbridge import doctor

    console = Console(stderr=args.json)
    if not args.json:
        console.print(
            f"kvbridge {__version__}: checking transports with a real transfer between two "
            "processes ..."
        )
    report = doctor.run(args.transport or None)
    if args.config is not None:
        from kvbridge.config import exposure_warning, load_config

        warning = exposure_warning(load_config(_read(args.config)))
        report["warnings"] = [warning] if warning else []
        if warning and not args.json:
            console.print(f"[yellow]warning:[/yellow] {warning}")
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        env = report["environment"]
        console.print(
            f"python {env['python']}, {env['cpus']} CPUs, RDMA devices: "
            f"{', '.join(env['rdma_devices']) or 'none'}"
        )
        table = Table()
        for col in ("transport", "imports", "works", "detail", "fix"):
            table.add_column(col)
        for c in report["transports"]:
            mark = lambda ok: "[green]yes[/green]" if ok else "[red]no[/red]"  # noqa: E731
            table.add_row(
                c["transport"], mark(c["imports"]), mark(c["works"]), c["detail"], c["fix"] or ""
            )
        console.print(table)
    return 0 if all(c["works"] for c in report["transports"]) else 1


def _config(args: argparse.Namespace) -> int:
    from kvbridge.config import exposure_warning, load_config
    from kvbridge.errors import ConfigError

    try:
        cfg = load_config(_read(args.source) or None)
    except ConfigError as exc:
        print(f"kvbridge config error: {exc}", file=sys.stderr)
        return 2
    if (warning := exposure_warning(cfg)) is not None:
        print(f"warning: {warning}", file=sys.stderr)
    print(json.dumps(msgspec.to_builtins(cfg), indent=None if args.json else 2))
    return 0


def _read(source: str | None) -> str | None:
    """A config argument: JSON text, or ``@path`` to a file of it."""
    return Path(source[1:]).read_text() if source and source.startswith("@") else source


def _proxy(args: argparse.Namespace) -> int:
    import asyncio
    import logging

    from kvbridge.proxy.app import Proxy, serve

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    proxy = Proxy(
        args.prefill,
        args.decode,
        flow=args.flow,
        timeout=args.timeout,
        read_timeout=args.read_timeout,
        max_connections=args.max_connections,
        first_token=args.first_token,
    )
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(proxy, args.host, args.port))
    return 0


def _demo(args: argparse.Namespace) -> int:
    from kvbridge.config import load_config
    from kvbridge.demo.model import has_states
    from kvbridge.errors import ConfigError

    try:  # before any server starts
        config = load_config(
            {
                "transport": args.transport,
                "wire_dtype": args.wire_dtype,
                "data_path": args.data_path,
            }
        )
    except ConfigError as exc:
        print(f"kvbridge demo: {exc}", file=sys.stderr)
        return 2
    mla = args.model == "mla"
    tp = (args.prefill_tp, args.decode_tp)
    if min(tp) < 1 or (max(tp) % min(tp)):
        print(
            f"kvbridge demo: --prefill-tp {tp[0]} --decode-tp {tp[1]}: one must be a multiple of "
            "the other (fix: e.g. 2 and 1)",
            file=sys.stderr,
        )
        return 2
    if has_states(args.model) and args.engine == "sglang":
        if args.model != "shortconv":
            print(
                f"kvbridge demo --model {args.model} --engine sglang: SGLang computes Mamba2 and "
                "Gated DeltaNet layers on CPU with native kernels that are not installable here "
                "(fix: --model shortconv, or --engine vllm)",
                file=sys.stderr,
            )
            return 2
    elif has_states(args.model) and config.packed:
        print(
            f"kvbridge demo --model {args.model}: states move between vLLM instances on the direct "
            "path (fix: leave --wire-dtype exact and --data-path auto, or --engine sglang with "
            "--model shortconv)",
            file=sys.stderr,
        )
        return 2
    if args.model == "swa" and args.engine != "sglang":
        print(
            "kvbridge demo --model swa: the sliding-window model (Laguna) runs on SGLang "
            "(fix: --engine sglang)",
            file=sys.stderr,
        )
        return 2
    if mla and config.packed and args.engine == "sglang" and tp[0] > tp[1]:
        print(
            "kvbridge demo --model mla --engine sglang: the packed path moves latent caches to a "
            "decode of at least the prefill's TP size (fix: leave --wire-dtype exact and "
            "--data-path auto, or raise --decode-tp)",
            file=sys.stderr,
        )
        return 2
    if args.engine == "sglang" and tp[0] != tp[1] and not config.packed and not mla:
        print(
            "kvbridge demo --engine sglang: different TP sizes move KV on the packed path only "
            "(fix: add --data-path packed, or --wire-dtype fp8)",
            file=sys.stderr,
        )
        return 2
    lengths = tuple(int(n) for n in args.prompt_tokens.split(","))
    logs = Path(args.logs) if args.logs else None
    if args.engine == "sglang":
        from kvbridge.demo.sglang_run import run as run_sglang

        if args.flow != "push":
            print(
                "kvbridge demo --engine sglang: --flow applies to vLLM only (SGLang's decode "
                "pre-allocates, the prefill pushes)",
                file=sys.stderr,
            )
            return 2
        return run_sglang(
            args.transport,
            lengths,
            args.max_tokens,
            logs,
            args.wire_dtype,
            args.data_path,
            tp,
            shape=args.model,
        )
    from kvbridge.demo.run import run

    return run(
        args.transport,
        lengths,
        args.max_tokens,
        args.flow,
        logs,
        args.wire_dtype,
        args.data_path,
        tp,
        shape=args.model,
    )


def _build_ops(args: argparse.Namespace) -> int:
    from kvbridge.errors import KVBridgeError
    from kvbridge.ops import jit

    try:
        print(jit.build(args.arch, verbose=args.verbose))
    except KVBridgeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kvbridge", description="KV-cache transfer for disaggregated LLM serving"
    )
    parser.add_argument("--version", action="version", version=f"kvbridge {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("doctor", help="check which transports import and work on this machine")
    p.add_argument("--json", action="store_true", help="machine-readable report on stdout")
    p.add_argument("--transport", action="append", help="check only this transport (repeatable)")
    p.add_argument(
        "--config",
        help="also check this kvbridge config (JSON or @file): warns when the side channel "
        "binds a non-loopback host without a secret",
    )
    p.set_defaults(func=_doctor)
    p = sub.add_parser("config", help="validate a kvbridge config and print the effective values")
    p.add_argument(
        "source", nargs="?", help="JSON text, or @path/to/file.json; omit for the defaults"
    )
    p.add_argument("--json", action="store_true", help="one line of JSON")
    p.set_defaults(func=_config)
    p = sub.add_parser(
        "proxy", help="OpenAI-compatible proxy in front of prefill and decode instances"
    )
    p.add_argument(
        "--prefill",
        action="append",
        required=True,
        metavar="URL",
        help="a prefill instance (repeatable)",
    )
    p.add_argument(
        "--decode",
        action="append",
        required=True,
        metavar="URL",
        help="a decode instance (repeatable)",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--flow",
        choices=("push", "pull", "sequential"),
        default="push",
        help=(
            "push: layer-wise, P and D at once (default); pull: P first, vLLM's "
            "kv_transfer_params protocol; sequential: P first, no kv_transfer_params needed "
            "(storage-sharing connectors such as vLLM's ExampleConnector)"
        ),
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=0.0,
        help="seconds a request may take end to end (0, the default: no limit)",
    )
    p.add_argument(
        "--read-timeout",
        type=float,
        default=600.0,
        help="seconds an instance may send nothing before its request fails (default 600)",
    )
    p.add_argument(
        "--max-connections",
        type=int,
        default=4096,
        help="open connections to the instances at most (default 4096)",
    )
    p.add_argument(
        "--first-token",
        type=int,
        default=0,
        metavar="TOKENS",
        help=(
            "push flow: a streamed completion whose prompt is at most TOKENS long (a text "
            "prompt: characters) gets its first token from the prefill, streamed at once, "
            "and the decode continues from it (0, the default: never)"
        ),
    )
    p.set_defaults(func=_proxy)
    p = sub.add_parser(
        "demo",
        help="run prefill/decode disaggregation on this machine and check it against colocated",
    )
    p.add_argument(
        "--engine",
        choices=("vllm", "sglang"),
        default="vllm",
        help=(
            "vllm (default) or sglang: SGLang servers with --disaggregation-transfer-backend "
            "kvbridge behind sglang_router (needs `make setup-sglang`, then "
            ".venv-sglang/bin/kvbridge demo --engine sglang)"
        ),
    )
    p.add_argument("--transport", choices=("nixl", "mooncake"), default="nixl")
    p.add_argument("--flow", choices=("push", "pull"), default="push", help="vLLM only")
    p.add_argument(
        "--prompt-tokens", default="64,512,1024,2048", help="comma-separated prompt lengths"
    )
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--logs", help="directory for the instances' logs (default: a temporary one)")
    p.add_argument(
        "--wire-dtype",
        choices=("exact", "fp8"),
        default="exact",
        help="KV on the wire (config key wire_dtype)",
    )
    p.add_argument(
        "--data-path",
        choices=("auto", "direct", "packed"),
        default="auto",
        help="cache to cache, or through staging (config key data_path)",
    )
    p.add_argument(
        "--prefill-tp",
        type=int,
        default=1,
        metavar="N",
        help="the prefill's tensor parallel size (default 1)",
    )
    p.add_argument(
        "--decode-tp",
        type=int,
        default=1,
        metavar="N",
        help="the decode's tensor parallel size (default 1)",
    )
    p.add_argument(
        "--model",
        choices=("tiny", "mla", "hybrid", "shortconv", "swa"),
        default="tiny",
        help=(
            "the demo model: tiny (Llama, default), mla (DeepSeek-V2: multi-head latent "
            "attention, one latent vector per token), hybrid (GraniteMoeHybrid: Mamba2 layers "
            "between attention layers; vLLM only), shortconv (LFM2: short convolutions "
            "between attention layers; vLLM and SGLang) or swa (Laguna: full-attention and "
            "sliding-window layers, in SGLang's sliding-window pool; SGLang only)"
        ),
    )
    p.set_defaults(func=_demo)
    p = sub.add_parser(
        "build-ops",
        help="build the CUDA pack/unpack kernels ahead of time (else built on first use)",
    )
    p.add_argument(
        "--arch", help="compute capability to build for, e.g. 9.0 (default: the current GPU's)"
    )
    p.add_argument("-v", "--verbose", action="store_true")
    p.set_defaults(func=_build_ops)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
