"""The proxy's first-token flow (:mod:`kvbridge.proxy.firsttoken`): which requests take
it, how the client's stream is stitched from the prefill's answer and the decode's
events, and the protocol against stand-in upstreams that record what they were sent
(engine behaviour: tests/integration/test_proxy.py, against colocated vLLM)."""

from __future__ import annotations

import asyncio
import itertools
import json
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from hypothesis import given
from hypothesis import strategies as st
from upstreams import serve as _serve

from kvbridge.proxy import firsttoken
from kvbridge.proxy.app import Proxy
from kvbridge.proxy.firsttoken import First, MalformedAnswer, OversizedEvent, Stitch, eligible

PATH = "/v1/completions"
BASE = {"model": "m", "prompt": [5, 6, 7], "max_tokens": 4, "stream": True, "temperature": 0}


@pytest.mark.parametrize(
    ("change", "takes_it"),
    [
        ({}, True),
        ({"prompt": "short text"}, True),  # 10 characters: at most 10 tokens
        ({"stream_options": {"include_usage": True}}, True),
        ({"stop": []}, True),
        ({"frequency_penalty": 0.0, "n": 1, "logprobs": None}, True),
        ({"seed": 3}, True),  # greedy: a seed changes nothing
        ({"max_tokens": None}, True),
        ({"stream": False}, False),  # no first token to speed up
        ({"stop": ["\n"]}, False),  # a stop string may span the two tokens
        ({"frequency_penalty": 0.5}, False),  # counts output tokens only
        ({"presence_penalty": 1}, False),
        ({"min_tokens": 2}, False),
        ({"n": 2}, False),
        ({"best_of": 2}, False),
        ({"logprobs": 0}, False),
        ({"echo": True}, False),
        ({"seed": 3, "temperature": 0.8}, False),  # the decode's generator starts over
        ({"max_tokens": 1}, False),
        ({"prompt": [[5, 6, 7]]}, False),  # a batch of prompts
        ({"prompt": list(range(11))}, False),  # over the limit
        ({"prompt": "x" * 11}, False),
        ({"response_format": {"type": "json_object"}}, False),  # unknown: not ours to judge
        ({"stream_options": {"include_usage": True, "other": 1}}, False),
    ],
)
def test_which_requests_take_the_prefill_s_first_token(
    change: dict[str, Any], takes_it: bool
) -> None:
    assert eligible(PATH, dict(BASE, **change), limit=10) is takes_it


def test_nothing_takes_it_when_off_or_on_another_endpoint() -> None:
    assert not eligible(PATH, BASE, limit=0)
    assert not eligible("/v1/chat/completions", BASE, limit=10)


def _answer(**choice: Any) -> dict[str, Any]:
    """A prefill's answer to the first-token request, as vLLM writes it."""
    base = {
        "index": 0,
        "text": " hi",
        "finish_reason": "length",
        "stop_reason": None,
        "token_ids": [42],
        "prompt_token_ids": [5, 6, 7],
    }
    return {
        "id": "cmpl-p",
        "object": "text_completion",
        "created": 7,
        "model": "m",
        "choices": [dict(base, **choice)],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
        "kv_transfer_params": {"do_remote_prefill": True, "kvbridge": {"transfer_id": "t"}},
    }


@pytest.mark.parametrize(
    "change",
    [
        {"token_ids": None},  # a vLLM without return_token_ids
        {"prompt_token_ids": [5, "6"]},
        {"token_ids": [1, 2]},
        {"text": None},
    ],
)
def test_an_answer_without_the_ids_is_refused(change: dict[str, Any]) -> None:
    with pytest.raises(MalformedAnswer):
        First(_answer(**change))


def _events(data: bytes) -> list[Any]:
    """The events of an SSE stream, decoded (``[DONE]`` as the string)."""
    out = []
    for block in data.split(b"\n\n"):
        if block:
            assert block.startswith(b"data: "), block
            payload = block[6:]
            out.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    return out


def _decode_stream(usage: bool) -> bytes:
    """A decode's stream continuing after the prefill's token: two tokens and usage, its
    prompt being the client's plus that token."""
    chunk = {"id": "cmpl-d", "object": "text_completion", "created": 8, "model": "m"}
    events = [
        dict(chunk, choices=[{"index": 0, "text": " a", "prompt_token_ids": [5, 6, 7, 42]}]),
        dict(chunk, choices=[{"index": 0, "text": " b", "finish_reason": "length"}]),
    ]
    if usage:
        events.append(
            dict(
                chunk,
                choices=[],
                usage={"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6},
            )
        )
    out = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
    return out + b"data: [DONE]\n\n"


@given(cuts=st.lists(st.integers(min_value=0, max_value=2000), max_size=12))
def test_the_decode_s_events_are_rewritten_wherever_the_stream_is_cut(cuts: list[int]) -> None:
    """Events come from the network cut anywhere; the client gets whole events, under the
    prefill's id, with usage counting the prefill's token as output and the prompt the
    client's."""
    body = dict(BASE, stream_options={"include_usage": True}, return_token_ids=True)
    stitch = Stitch(body, First(_answer()))
    stream = _decode_stream(usage=True)
    points = sorted({min(c, len(stream)) for c in cuts} | {0, len(stream)})
    out = b"".join(stitch.feed(stream[a:b]) for a, b in itertools.pairwise(points))
    assert stitch.rest() == b""
    events = _events(out)
    assert events[-1] == "[DONE]"
    assert {e["id"] for e in events[:-1]} == {"cmpl-p"}
    assert [c["text"] for e in events[:-1] for c in e["choices"]] == [" a", " b"]
    assert events[0]["choices"][0]["prompt_token_ids"] is None
    assert events[2]["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}


def test_the_opening_is_the_prefill_s_token_as_vllm_streams_one() -> None:
    body = dict(BASE, return_token_ids=True, stream_options={"include_usage": True})
    (event,) = _events(Stitch(body, First(_answer())).opening())
    assert event["id"] == "cmpl-p" and event["object"] == "text_completion"
    assert event["choices"] == [
        {
            "index": 0,
            "text": " hi",
            "logprobs": None,
            "finish_reason": None,  # the decode goes on
            "stop_reason": None,
            "prompt_token_ids": [5, 6, 7],
            "token_ids": [42],
        }
    ]
    assert "usage" not in event, "usage comes once, at the end, unless continuous"


def test_a_first_token_that_ended_the_request_is_the_whole_stream() -> None:
    body = dict(BASE, stream_options={"include_usage": True})
    answer = _answer(finish_reason="stop", stop_reason=42, text="")
    first = First(answer)
    assert first.last
    choice, usage, done = _events(Stitch(body, first).opening())
    assert choice["choices"][0]["finish_reason"] == "stop"
    assert choice["choices"][0]["stop_reason"] == 42
    assert choice["choices"][0]["token_ids"] is None, "not asked for"
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 1
    assert done == "[DONE]"


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12,
)
_vllm_keys = st.sampled_from(["id", "choices", "usage", "prompt_token_ids", "completion_tokens"])
_event_bytes = st.one_of(
    st.binary(max_size=64),  # anything at all
    st.dictionaries(_vllm_keys, _json, max_size=4).map(  # vLLM's keys, any values
        lambda d: b"data: " + json.dumps(d).encode()
    ),
    _json.map(lambda v: b"data: " + json.dumps(v).encode()),
)


@given(events=st.lists(_event_bytes, max_size=8), cuts=st.lists(st.integers(0, 4000)))
def test_no_stream_of_the_decode_s_stops_the_stitching(
    events: list[bytes], cuts: list[int]
) -> None:
    """The decode's stream is network input: whatever its events hold, cut wherever,
    :meth:`Stitch.feed` never raises (one that raised would end the client's stream
    without its error event), gives what the stream fed whole gives, and keeps only an
    unended event back."""
    stream = b"".join(e + b"\n\n" for e in events)
    body = dict(BASE, return_token_ids=True, stream_options={"include_usage": True})
    whole = Stitch(body, First(_answer()))
    expected = whole.feed(stream)
    stitch = Stitch(body, First(_answer()))
    points = sorted({min(c, len(stream)) for c in cuts} | {0, len(stream)})
    out = b"".join(stitch.feed(stream[a:b]) for a, b in itertools.pairwise(points))
    assert out == expected
    assert stitch.rest() == whole.rest() == stream.split(b"\n\n")[-1]


def test_an_event_whose_choices_are_not_a_list_passes() -> None:
    stitch = Stitch(BASE, First(_answer()))
    assert json.loads(stitch.feed(b'data: {"choices": 5}\n\n')[6:])["choices"] == 5


def test_an_event_that_never_ends_is_cut_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """The decode sends bytes without ending an event: the stitching waits for the end
    only up to :data:`~kvbridge.proxy.firsttoken.MAX_EVENT_BYTES`."""
    monkeypatch.setattr(firsttoken, "MAX_EVENT_BYTES", 1000)
    stitch = Stitch(BASE, First(_answer()))
    assert stitch.feed(b"data: " + b"x" * 900) == b""
    with pytest.raises(OversizedEvent, match="without ending an event"):
        stitch.feed(b"x" * 200)


def test_an_error_event_from_the_decode_passes_unchanged() -> None:
    stitch = Stitch(BASE, First(_answer()))
    error = b'data: {"error": {"message": "boom", "code": 500}}\n\n'
    assert stitch.feed(error) == error


# --- through the proxy, against stand-in upstreams --------------------------------------


async def _run(
    prefill_answer: dict[str, Any],
    decode: Any,
    body: dict[str, Any],
) -> tuple[int, bytes, list[dict], list[dict]]:
    """One client request through a proxy with ``--first-token 16`` in front of a prefill
    answering ``prefill_answer`` (to the client's request; the proxy's discovery gets
    a side-channel address) and a decode served by the handler ``decode``."""
    p_seen: list[dict] = []
    d_seen: list[dict] = []

    async def prefill(request: web.Request) -> web.Response:
        seen = await request.json()
        p_seen.append(seen)
        if seen["kv_transfer_params"]["kvbridge"].get("flow") == "discover":
            address = {"address": "127.0.0.1:1", "engine_id": "p", "epoch": "e"}
            return web.json_response({"kv_transfer_params": {"kvbridge": {"prefill": address}}})
        return web.json_response(prefill_answer)

    async def decode_handler(request: web.Request) -> web.StreamResponse:
        d_seen.append(await request.json())
        return await decode(request)

    runners = []
    try:
        for handler in (prefill, decode_handler):
            app = web.Application()
            app.router.add_post(PATH, handler)
            runners.append(await _serve(app))
        (_, p_url), (_, d_url) = runners
        proxy = Proxy([p_url], [d_url], timeout=10, first_token=16)
        runners.append(await _serve(proxy.app()))
        async with (
            aiohttp.ClientSession() as client,
            client.post(f"{runners[-1][1]}{PATH}", json=body) as resp,
        ):
            return resp.status, await resp.read(), p_seen, d_seen
    finally:
        for runner, _ in runners:
            await runner.cleanup()


async def _streams(request: web.Request) -> web.StreamResponse:
    out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await out.prepare(request)
    await out.write(_decode_stream(usage=False))
    await out.write_eof()
    return out


def test_the_prefill_answers_first_and_the_decode_continues_from_its_token() -> None:
    status, data, p_seen, d_seen = asyncio.run(_run(_answer(), _streams, BASE))
    assert status == 200
    events = _events(data)
    assert [c["text"] for e in events[:-1] for c in e["choices"]] == [" hi", " a", " b"]
    (sent,) = p_seen
    assert sent["max_tokens"] == 1 and "stream" not in sent and sent["return_token_ids"]
    assert sent["kv_transfer_params"]["kvbridge"]["first_token"] is True
    (cont,) = d_seen
    assert cont["prompt"] == [5, 6, 7, 42] and cont["max_tokens"] == 3 and cont["stream"]
    assert cont["kv_transfer_params"] == _answer()["kv_transfer_params"]


@pytest.mark.parametrize("text", ["\ufffd", ""])
def test_a_first_token_that_is_part_of_a_character_is_left_to_the_decode(text: str) -> None:
    """vLLM writes U+FFFD, or nothing, for a token that is part of a multibyte
    character; a decode continuing from it would put out prompt text (``First.whole``).
    The client gets the decode's own answer to its request, P-first: nothing of the
    prefill's token."""
    answer = _answer(text=text)
    status, data, _, d_seen = asyncio.run(_run(answer, _streams, BASE))
    assert status == 200
    assert [c["text"] for e in _events(data)[:-1] for c in e["choices"]] == [" a", " b"]
    (sent,) = d_seen
    assert sent["prompt"] == [5, 6, 7] and sent["max_tokens"] == 4 and sent["stream"]
    assert sent["kv_transfer_params"] == answer["kv_transfer_params"]


def test_a_first_token_that_ended_it_opens_no_decode() -> None:
    answer = _answer(finish_reason="stop", stop_reason=None)
    status, data, _, d_seen = asyncio.run(_run(answer, _streams, BASE))
    assert status == 200 and d_seen == []
    assert _events(data)[-1] == "[DONE]"


def test_a_decode_that_refuses_the_continuation_ends_the_stream_with_an_error() -> None:
    """The client has its first token (a status line, an event): the decode's refusal
    comes as an error event, then ``[DONE]``, as vLLM ends a failed stream."""

    async def refuses(request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "prompt too long"}}, status=400)

    status, data, _, _ = asyncio.run(_run(_answer(), refuses, BASE))
    first, error, done = _events(data)
    assert status == 200 and first["choices"][0]["text"] == " hi" and done == "[DONE]"
    assert "prompt too long" in error["error"]["message"]
    assert "decode instance" in error["error"]["message"]


def test_a_decode_event_that_never_ends_ends_the_client_s_stream_with_an_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(firsttoken, "MAX_EVENT_BYTES", 1000)

    async def endless(request: web.Request) -> web.StreamResponse:
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        for _ in range(8):
            await out.write(b"data: " + b"x" * 500)
        await out.write_eof()
        return out

    status, data, _, _ = asyncio.run(_run(_answer(), endless, BASE))
    first, error, done = _events(data)
    assert status == 200 and first["choices"][0]["text"] == " hi" and done == "[DONE]"
    assert "without ending an event" in error["error"]["message"]


def test_a_prefill_answer_without_ids_is_a_502_naming_it() -> None:
    status, data, _, d_seen = asyncio.run(_run(_answer(token_ids=None), _streams, BASE))
    assert status == 502 and d_seen == []
    assert b"prefill instance http://127.0.0.1:" in data and b"token ids" in data


def test_a_request_that_does_not_take_it_is_pushed() -> None:
    status, _, p_seen, d_seen = asyncio.run(_run(_answer(), _streams, dict(BASE, stop=["x"])))
    assert status == 200
    assert "first_token" not in p_seen[-1]["kv_transfer_params"]["kvbridge"]
    assert d_seen[0]["prompt"] == BASE["prompt"], "the decode computes the first token"
