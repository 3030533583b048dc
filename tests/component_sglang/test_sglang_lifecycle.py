"""kvbridge's SGLang bootstrap server tells a restarted prefill from the one before.

The real bootstrap server class (SGLang's aiohttp server plus kvbridge's epoch route),
started, registered with as a prefill rank does, stopped and started again on the same
port, as a restarted prefill instance would; the decode-side :class:`EpochWatcher`
fed by the same HTTP fetch the decode manager uses. Runs in .venv-sglang.
"""

from __future__ import annotations

import socket
import time

import pytest
import requests

try:
    import sglang  # noqa: F401
except ImportError as exc:  # pragma: no cover
    raise RuntimeError(
        "tests/integration_sglang needs .venv-sglang: bash scripts/setup-sglang.sh"
    ) from exc

from kvbridge.adapters.sglang.lifecycle import EpochWatcher, Verdict


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _registration(rank_port: int, epoch: str, tp_rank: int = 0, tp_size: int = 1) -> dict:
    """What a prefill rank PUTs to /route (SGLang's fields, plus kvbridge's epoch)."""
    return {
        "attn_tp_size": tp_size,
        "attn_tp_rank": tp_rank,
        "attn_cp_size": 1,
        "attn_cp_rank": 0,
        "attn_dp_size": 1,
        "attn_dp_rank": 0,
        "pp_size": 1,
        "pp_rank": 0,
        "system_dp_size": 1,
        "system_dp_rank": 0,
        "rank_ip": "127.0.0.1",
        "rank_port": rank_port,
        "page_size": 16,
        "kv_cache_dtype": "auto",
        "kvbridge_epoch": epoch,
    }


def _start(port: int):
    from kvbridge.adapters.sglang.bootstrap import KVBridgeKVBootstrapServer

    server = KVBridgeKVBootstrapServer("127.0.0.1", port)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if requests.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return server
        except requests.ConnectionError:
            pass
        time.sleep(0.1)
    server.close()
    raise RuntimeError(f"bootstrap server on {port} not up after 30 s")


def test_restart_on_the_same_port_is_a_new_instance() -> None:
    from kvbridge.adapters.sglang.decode import fetch_epoch

    port = _free_port()
    addr = f"127.0.0.1:{port}"
    watcher = EpochWatcher()
    first = _start(port)
    try:
        epoch, refused = fetch_epoch(addr, timeout=2)
        assert epoch is not None and not refused
        assert not epoch.ready and epoch.ranks == {}  # no rank registered yet
        for tp in (0, 1):
            r = requests.put(
                f"http://{addr}/route",
                json=_registration(7000 + tp, f"rank{tp}-a", tp, 2),
                timeout=5,
            )
            assert r.status_code == 200, r.text
        epoch, _ = fetch_epoch(addr, timeout=2)
        assert epoch.ready
        assert epoch.ranks == {"dp0/cp0/tp0/pp0": "rank0-a", "dp0/cp0/tp1/pp0": "rank1-a"}
        # SGLang's own /route answers are unchanged (the decode builds PrefillServerInfo(**json))
        info = requests.get(
            f"http://{addr}/route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1",
            timeout=5,
        )
        assert info.status_code == 200 and "kvbridge" not in info.text
        watcher.remember(addr, epoch)
        assert watcher.observe(addr, fetch_epoch(addr, timeout=2)[0]) is Verdict.SAME
    finally:
        first.close()

    assert fetch_epoch(addr, timeout=2) == (None, True)  # down: connection refused
    # one refusal is not death
    assert watcher.observe(addr, None, refused=True) is Verdict.UNANSWERED

    second = _start(port)  # the restarted prefill, same port, registering the same way
    try:
        for tp in (0, 1):
            requests.put(
                f"http://{addr}/route",
                json=_registration(7100 + tp, f"rank{tp}-b", tp, 2),
                timeout=5,
            ).raise_for_status()
        epoch, _ = fetch_epoch(addr, timeout=2)
        assert epoch.instance != watcher.known(addr).instance
        assert watcher.observe(addr, epoch) is Verdict.RESTARTED
    finally:
        second.close()


@pytest.mark.parametrize("body", [b"<html>not an epoch</html>"])
def test_a_foreign_answer_is_no_epoch(body: bytes) -> None:
    """A prefill without kvbridge's route (another backend) gives no epoch, not an error."""
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    from kvbridge.adapters.sglang.decode import fetch_epoch

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        assert fetch_epoch(f"127.0.0.1:{server.server_port}", timeout=2) == (None, False)
    finally:
        server.shutdown()
        server.server_close()
