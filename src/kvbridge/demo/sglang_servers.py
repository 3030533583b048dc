"""Run real SGLang servers on CPU, and ``sglang_router``'s mini load balancer in front of a
prefill/decode pair, as supervised child processes.

:class:`SglangServer` starts ``python -m sglang.launch_server --device cpu`` with the
flags and environment SGLang 0.5.23 needs on a CPU machine (:data:`CPU_ARGS`,
:data:`CPU_ENV`; why each one: docs/reference/sglang.md), colocated or as the
prefill or decode side of a disaggregated pair with any
``--disaggregation-transfer-backend`` (``kvbridge``, whose config travels in
``KVBRIDGE_CONFIG``, or another). :class:`SglangRouter` starts
``python -m sglang_router.launch_router --pd-disaggregation --mini-lb`` in front of one
pair. Both are :class:`~kvbridge.demo.servers.ServerProcess`\\ es: own process group,
log file, ``wait_ready`` with a deadline that quotes the log's last lines, optional CPU
pinning, nothing left running after ``stop``. Unlike vLLM, :meth:`SglangServer.stop`
SIGKILLs the group at once: on SIGTERM a disaggregated SGLang server drains in-flight
requests, and a stuck transfer keeps it alive for good.

Requests: :func:`generate` (``/generate`` with token ids, greedy, the output ids) and
:func:`stream_generate` (the same streamed: TTFT, TPOT and the ids). SGLang runs in the
child processes and is never imported here (:func:`require_sglang` only looks for it).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from kvbridge.demo.servers import ServerProcess, Timing, free_port, post_json, timed_stream
from kvbridge.errors import KVBridgeError

CPU_ARGS: tuple[str, ...] = (
    "--device", "cpu",
    "--attention-backend", "torch_native",  # the CPU default needs AMX
    "--mem-fraction-static", "0.3",  # of host memory as seen at start; capped by:
    "--max-total-tokens", "65536",
    "--sleep-on-idle",  # an idle scheduler spins a core otherwise (measured: ~95% each)
)  # fmt: skip
"""Flags every SGLang server started here gets (before the caller's ``extra_args``)."""

CPU_ENV: dict[str, str] = {
    "SGLANG_USE_CPU_ENGINE": "1",
    "HF_HUB_OFFLINE": "1",  # no model hub here; never try one
    "TRANSFORMERS_OFFLINE": "1",
    "SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX": "0",  # records a CUDA event otherwise
    "MC_LOG_LEVEL": "ERROR",  # Mooncake logs every batch otherwise
    "PYTHONUNBUFFERED": "1",  # the log shows what happened up to a crash
    "TOKENIZERS_PARALLELISM": "false",
}
"""Set in the server's environment unless the caller's environment already sets them."""

DECODE_ARGS: tuple[str, ...] = ("--disaggregation-decode-retraction-backup", "cpu_tensor")
"""The decode side's CPU flag: the default retraction backup builds a CUDA host pool."""

SETUP_FIX = "make setup-sglang, then .venv-sglang/bin/kvbridge demo --engine sglang"


def omp_bind(ranks: int, cores: Sequence[int]) -> str:
    """``SGLANG_CPU_OMP_THREADS_BIND`` for ``ranks`` TP ranks on ``cores``: consecutive
    equal shares, ``|``-separated (ranks share cores when there are fewer cores).

    >>> omp_bind(2, [0, 1, 2, 3]), omp_bind(2, [5]), omp_bind(3, [0, 1])
    ('0,1|2,3', '5|5', '0|1|0')
    """
    if len(cores) >= ranks:
        share = len(cores) // ranks
        return "|".join(
            ",".join(map(str, cores[r * share : (r + 1) * share])) for r in range(ranks)
        )
    return "|".join(str(cores[r % len(cores)]) for r in range(ranks))


def require_sglang(python: str = sys.executable) -> None:
    """Raise :class:`~kvbridge.errors.KVBridgeError` (naming the fix) unless SGLang and
    ``sglang_router`` are importable here (the servers run with this interpreter)."""
    missing = [m for m in ("sglang", "sglang_router") if importlib.util.find_spec(m) is None]
    if missing:
        raise KVBridgeError(
            f"SGLang is not installed for {python} (missing: {', '.join(missing)})", fix=SETUP_FIX
        )


class SglangServer(ServerProcess):
    """One SGLang server on CPU (API server, scheduler and detokenizer processes).

    Args:
        model_dir: a Hugging Face model directory (e.g. from
            :func:`kvbridge.demo.model.build_tiny_model`).
        extra_args: appended to the command line (``--page-size 16``, ...).
        env: environment overrides, applied last (over :data:`CPU_ENV` and ours).
        mode: ``None`` (colocated), ``"prefill"`` or ``"decode"``.
        backend: ``--disaggregation-transfer-backend`` when disaggregated.
        kvbridge_config: kvbridge's config (``KVBRIDGE_CONFIG``), e.g. ``{"transport":
        "mooncake"}``.
        bootstrap_port: the prefill's ``--disaggregation-bootstrap-port``; default: a
            free one (prefill only; the router needs it, :attr:`bootstrap_port`).
        tp: ``--tp``; with more than one rank each is bound to its share of the cores
            (``cpus``, default all this process may use; :func:`omp_bind`), which SGLang
            on CPU requires once ranks outnumber NUMA nodes.
        port, log_path, ready_timeout, python, cpus, nice: see
            :class:`~kvbridge.demo.servers.ServerProcess`.

    Ready means ``/health`` answers 200; there is no warm-up request (a prefill or
    decode server alone cannot serve one): warm up through the router.
    """

    name = "SGLang server"
    default_env = CPU_ENV
    stop_grace_s = None  # SIGKILL: a disaggregated server may drain forever on SIGTERM
    preload_ignored_env = ("KVBRIDGE_CONFIG",)  # read when the scheduler builds our manager

    def __init__(
        self,
        model_dir: str | os.PathLike[str],
        port: int | None = None,
        extra_args: Iterable[str] = (),
        env: Mapping[str, str] | None = None,
        log_path: str | os.PathLike[str] | None = None,
        *,
        mode: str | None = None,
        backend: str = "kvbridge",
        kvbridge_config: Mapping[str, Any] | None = None,
        bootstrap_port: int | None = None,
        tp: int = 1,
        ready_timeout: float = 300.0,
        python: str = sys.executable,
        cpus: Sequence[int] | None = None,
        nice: int = 0,
    ) -> None:
        if mode not in (None, "prefill", "decode"):
            raise KVBridgeError(
                f"unknown SGLang server mode {mode!r}",
                fix="use None (colocated), 'prefill' or 'decode'",
            )
        super().__init__(
            port, env, log_path, ready_timeout=ready_timeout, python=python, cpus=cpus, nice=nice
        )
        self.model_dir = Path(model_dir)
        self.extra_args = list(extra_args)
        self.mode = mode
        self.backend = backend
        self.kvbridge_config = dict(kvbridge_config) if kvbridge_config is not None else None
        self.bootstrap_port = (bootstrap_port or free_port()) if mode == "prefill" else None
        if tp < 1:
            raise KVBridgeError(
                f"SGLang server with --tp {tp}", fix="use a tensor parallel size of at least 1"
            )
        self.tp = tp

    def command(self) -> list[str]:
        disagg: list[str] = []
        if self.mode is not None:
            disagg = [
                "--disaggregation-mode",
                self.mode,
                "--disaggregation-transfer-backend",
                self.backend,
            ]
            if self.mode == "prefill":
                disagg += ["--disaggregation-bootstrap-port", str(self.bootstrap_port)]
            else:
                disagg += DECODE_ARGS
        return [
            self.python, "-m", "sglang.launch_server",
            "--model-path", str(self.model_dir),
            "--host", "127.0.0.1",
            "--port", str(self.port),
            *CPU_ARGS, *(["--tp", str(self.tp)] if self.tp > 1 else []), *disagg, *self.extra_args,
        ]  # fmt: skip

    def _own_env(self) -> dict[str, str]:
        env = (
            {}
            if self.kvbridge_config is None
            else {"KVBRIDGE_CONFIG": json.dumps(self.kvbridge_config)}
        )
        if self.tp > 1:
            env["SGLANG_CPU_OMP_THREADS_BIND"] = omp_bind(
                self.tp, self.cpus or sorted(os.sched_getaffinity(0))
            )
        return env

    def generate(
        self, input_ids: Sequence[int], max_new_tokens: int = 16, **kwargs: Any
    ) -> list[int]:
        """:func:`generate` against this server; a failure quotes the log if it died."""
        return self.call(generate, input_ids, max_new_tokens, **kwargs)


class SglangRouter(ServerProcess):
    """``sglang_router``'s mini load balancer (``--pd-disaggregation --mini-lb``) in front
    of one prefill and one decode server: it gives each request a bootstrap room and
    sends it to both at once, and answers with the decode's response.

    Args:
        prefill_url: the prefill server's URL.
        bootstrap_port: the prefill's bootstrap port (:attr:`SglangServer.bootstrap_port`).
        decode_url: the decode server's URL.
        port, env, log_path, ready_timeout, python, nice: see
            :class:`~kvbridge.demo.servers.ServerProcess`.
    """

    name = "sglang_router mini_lb"
    stop_grace_s = 10.0

    def __init__(
        self,
        prefill_url: str,
        bootstrap_port: int,
        decode_url: str,
        port: int | None = None,
        env: Mapping[str, str] | None = None,
        log_path: str | os.PathLike[str] | None = None,
        *,
        ready_timeout: float = 60.0,
        python: str = sys.executable,
        nice: int = 0,
    ) -> None:
        super().__init__(port, env, log_path, ready_timeout=ready_timeout, python=python, nice=nice)
        self.prefill_url, self.bootstrap_port, self.decode_url = (
            prefill_url,
            bootstrap_port,
            decode_url,
        )

    def command(self) -> list[str]:
        return [
            self.python, "-m", "sglang_router.launch_router", "--pd-disaggregation", "--mini-lb",
            "--prefill", self.prefill_url, str(self.bootstrap_port),
            "--decode", self.decode_url,
            "--host", "127.0.0.1", "--port", str(self.port),
        ]  # fmt: skip

    def generate(
        self, input_ids: Sequence[int], max_new_tokens: int = 16, **kwargs: Any
    ) -> list[int]:
        """:func:`generate` through the router; a failure quotes its log if it died."""
        return self.call(generate, input_ids, max_new_tokens, **kwargs)


def _body(
    input_ids: Sequence[int], max_new_tokens: int, ignore_eos: bool, stream: bool
) -> dict[str, Any]:
    params = {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": ignore_eos}
    return {"input_ids": list(input_ids), "sampling_params": params, "stream": stream}


def generate(
    url: str,
    input_ids: Sequence[int],
    max_new_tokens: int = 16,
    *,
    timeout: float = 120.0,
    ignore_eos: bool = False,
) -> list[int]:
    """POST ``/generate`` with token ids, greedy; the generated token ids. Raises
    :class:`~kvbridge.demo.servers.ServerError` or :class:`~kvbridge.errors.DeadlineExceeded`."""
    return list(
        post_json(f"{url}/generate", _body(input_ids, max_new_tokens, ignore_eos, False), timeout)[
            "output_ids"
        ]
    )


def stream_generate(
    url: str,
    input_ids: Sequence[int],
    max_new_tokens: int,
    *,
    timeout: float = 300.0,
    ignore_eos: bool = True,
) -> Timing:
    """:func:`generate` streamed (each event carries all ids so far): TTFT, TPOT and the
    token ids. ``ignore_eos`` (default) makes the output exactly ``max_new_tokens`` long."""
    body = _body(input_ids, max_new_tokens, ignore_eos, True)
    return timed_stream(
        f"{url}/generate", body, lambda e: e.get("output_ids"), cumulative=True, timeout=timeout
    )


__all__ = [
    "CPU_ARGS",
    "CPU_ENV",
    "DECODE_ARGS",
    "SETUP_FIX",
    "SglangRouter",
    "SglangServer",
    "generate",
    "omp_bind",
    "require_sglang",
    "stream_generate",
]
