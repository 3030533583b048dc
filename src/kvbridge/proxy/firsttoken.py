"""The prefill's first token: a short streamed completion's first token comes from the
prefill instance, not from the decode's first step.

In the push flow a short prompt's time to first token is the prefill's forward, then the
decode's first step (one time-per-output-token), then the proxy's hop. Here the proxy
sends the prefill first (P-first, ``max_tokens: 1``), streams the token it sampled to the
client as soon as it answers, and then opens the decode with the prompt plus that token
and one token fewer to go: the decode loads the blocks the prefill holds
(``kvbridge.remote_tokens``) and computes the one position it lacks as its first step,
which now makes the second token. TTFT is the prefill's; the second token waits for the
whole (P-first) transfer and that step.

Only requests for which the stitched answer is the colocated answer take this way
(:func:`eligible`): a streamed ``/v1/completions`` request with one prompt, of at most
the proxy's limit in tokens, whose every field is in :data:`FIELDS` and harmless. Stop
strings, penalties on output tokens, multi-token bad words, structured output, seeded
sampling, logprobs, echo and ``n > 1`` would see the first token as part of the decode's
prompt, not of its output; they go the push way. A prefill whose first token ends the
request (an EOS or stop token) answers the client alone and, told that a decode continues
from its token (``kvbridge.first_token``), holds no blocks for one.

Who calls: :class:`kvbridge.proxy.app.Proxy`, per eligible request: :func:`prefill_body`,
then :class:`Stitch` over the prefill's answer (the first events) and every event of the
decode's stream, then :func:`decode_body`. Pure functions of the request and the answers;
no I/O here.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

FIELDS = frozenset(
    {
        "model",
        "prompt",
        "max_tokens",
        "stream",
        "stream_options",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "repetition_penalty",
        "ignore_eos",
        "stop",
        "stop_token_ids",
        "include_stop_str_in_output",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "return_token_ids",
        "logit_bias",
        "allowed_token_ids",
        "frequency_penalty",
        "presence_penalty",
        "min_tokens",
        "seed",
        "n",
        "best_of",
        "logprobs",
        "echo",
        "user",
        "priority",
    }
)
"""The fields a request may carry and take the prefill's first token (:func:`eligible`
checks the values of those that could make the stitched answer differ: ``repetition_penalty``
counts prompt and output tokens alike, the penalties below count output tokens only)."""

_OFF: dict[str, tuple[Any, ...]] = {
    "stop": (None, "", []),
    "frequency_penalty": (None, 0),
    "presence_penalty": (None, 0),
    "min_tokens": (None, 0),
    "n": (None, 1),
    "best_of": (None, 1),
    "logprobs": (None,),
    "echo": (None, False),
}
"""Fields in :data:`FIELDS` allowed only at these values (their defaults)."""

MAX_EVENT_BYTES = 16 << 20
"""The longest event of the decode's stream :class:`Stitch` waits for the end of (vLLM's
longest, the first with the prompt's ids, is ~8 bytes a token)."""


def prompt_size(body: dict[str, Any]) -> int | None:
    """A request's one prompt's size: token ids, or a text's characters (at least its
    tokens for the tokenizers in use); None for anything else (several prompts)."""
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (prompt and _ids(prompt)):
        return len(prompt)
    return None


def eligible(path: str, body: dict[str, Any], limit: int) -> bool:
    """Whether the request ``body`` to ``path`` takes the prefill's first token: a
    streamed completion of one prompt of at most ``limit`` (:func:`prompt_size`), at
    least two tokens long, with only :data:`FIELDS`, each harmless (module docstring)."""
    if limit <= 0 or path != "/v1/completions" or body.get("stream") is not True:
        return False
    if not FIELDS.issuperset(body) or any(body.get(k) not in v for k, v in _OFF.items()):
        return False
    size = prompt_size(body)
    if size is None or size > limit:
        return False
    max_tokens = body.get("max_tokens")
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 2):
        return False
    if "seed" in body and body.get("temperature") != 0:
        return False  # the decode's generator would start over at its first token
    options = body.get("stream_options")
    return options is None or (
        isinstance(options, dict)
        and {"include_usage", "continuous_usage_stats"}.issuperset(options)
    )


def prefill_body(body: dict[str, Any], transfer_id: str) -> dict[str, Any]:
    """The prefill's request: the client's, not streamed, one token, its ids returned,
    P-first with kvbridge told that a decode continues from its token."""
    out = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    out.update(
        max_tokens=1,
        return_token_ids=True,
        kv_transfer_params={
            "kvbridge": {
                "transfer_id": transfer_id,
                "role": "prefill",
                "flow": "pull",
                "first_token": True,
            }
        },
    )
    return out


class MalformedAnswer(ValueError):
    """The prefill's answer lacks what the decode's request is built from."""


class OversizedEvent(ValueError):
    """The decode's stream sent more than :data:`MAX_EVENT_BYTES` without ending an
    event (:meth:`Stitch.feed`)."""


class First:
    """The prefill's answer, read: its first token and what the decode needs."""

    def __init__(self, result: dict[str, Any]) -> None:
        """``result``: the prefill's JSON answer (a dict); :class:`MalformedAnswer` if it
        lacks a choice with the prompt's and the token's ids."""
        choices = result.get("choices")
        if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
            raise MalformedAnswer("an answer without exactly one choice")
        choice = choices[0]
        prompt_ids, token_ids = choice.get("prompt_token_ids"), choice.get("token_ids")
        if not _ids(prompt_ids) or not _ids(token_ids) or len(token_ids) > 1:
            raise MalformedAnswer(
                "an answer without the prompt's token ids and at most one token's id (is it "
                "a vLLM recent enough for return_token_ids?)"
            )
        text = choice.get("text")
        if not isinstance(text, str):
            raise MalformedAnswer("an answer whose choice has no text")
        self.result = result
        self.choice = choice
        self.prompt_ids: list[int] = prompt_ids
        self.token_ids: list[int] = token_ids
        self.text = text
        self.params = result.get("kv_transfer_params") or None
        finish = choice.get("finish_reason")
        self.last = finish != "length" or not token_ids
        """The prefill's token ended the request (an EOS or stop token): no decode."""
        self.whole = whole(text)
        """The token's text is whole characters (:func:`whole`)."""


def whole(text: str) -> bool:
    """Whether a token's text is whole characters. For a token that is part of one,
    vLLM's text is empty (held back) or has U+FFFD; such a token cannot be continued:
    the decode's detokenizer, primed with a prompt that ends mid-character, puts out
    prompt text with its first token (measured: vLLM 0.32, a byte-level tokenizer;
    vLLM's ``FastIncrementalDetokenizer``, vllm-project/vllm#48853)."""
    return bool(text) and "\ufffd" not in text


def _ids(value: Any) -> bool:
    """Whether ``value`` is a list of token ids (ints, not bools)."""
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    )


def decode_body(body: dict[str, Any], first: First) -> dict[str, Any]:
    """The decode's request: the client's, its prompt the prefill's prompt ids and token,
    one token fewer, with the prefill's ``kv_transfer_params``."""
    out = dict(body, prompt=first.prompt_ids + first.token_ids)
    if isinstance(body.get("max_tokens"), int):
        out["max_tokens"] = body["max_tokens"] - 1
    if first.params is not None:
        out["kv_transfer_params"] = first.params
    return out


class Stitch:
    """The client's stream, from the prefill's first token and the decode's events.

    Contract: :meth:`opening` once, first; then :meth:`feed` with every chunk of the
    decode's stream, in order, as it comes (events may be cut anywhere); its output goes
    to the client as it is. An event that is not vLLM's passes as it came; one longer than
    :data:`MAX_EVENT_BYTES` raises :class:`OversizedEvent`. One per request; not
    thread-safe (the proxy's event loop).
    """

    def __init__(self, body: dict[str, Any], first: First) -> None:
        self._first = first
        self._ids = bool(body.get("return_token_ids"))
        options = body.get("stream_options") or {}
        self._usage = bool(options.get("include_usage"))
        self._continuous = self._usage and bool(options.get("continuous_usage_stats"))
        self._id = first.result.get("id") or f"cmpl-{uuid.uuid4().hex}"
        self._buffer = b""

    def _usage_of(self, completion: int) -> dict[str, int]:
        prompt = len(self._first.prompt_ids)
        return {
            "prompt_tokens": prompt,
            "total_tokens": prompt + completion,
            "completion_tokens": completion,
        }

    def opening(self) -> bytes:
        """The events for the prefill's token, as vLLM streams a token; with the usage
        event (when asked) and ``[DONE]`` when the token ended the request."""
        first, result = self._first, self._first.result
        head = {
            "id": self._id,
            "object": "text_completion",
            "created": result.get("created"),
            "model": result.get("model"),
        }
        choice: dict[str, Any] = {
            "index": 0,
            "text": first.text,
            "logprobs": None,
            "finish_reason": first.choice.get("finish_reason") if first.last else None,
            "stop_reason": first.choice.get("stop_reason") if first.last else None,
            "prompt_token_ids": first.prompt_ids if self._ids else None,
            "token_ids": first.token_ids if self._ids else None,
        }
        event: dict[str, Any] = dict(head, choices=[choice])
        if self._continuous:
            event["usage"] = self._usage_of(len(first.token_ids))
        if not first.last:
            return _event(event)
        fingerprint = {"system_fingerprint": result.get("system_fingerprint")}
        out = _event(dict(event, **fingerprint))
        if self._usage:
            usage = self._usage_of(len(first.token_ids))
            out += _event(dict(head, choices=[], usage=usage, **fingerprint))
        return out + b"data: [DONE]\n\n"

    def feed(self, chunk: bytes) -> bytes:
        """The decode's stream bytes ``chunk``, as the client gets them: whole events
        only (a cut one waits for its end), each under the prefill's id, its usage
        counting the prefill's token as output, the prompt ids the client's."""
        self._buffer += chunk
        *events, self._buffer = self._buffer.split(b"\n\n")
        if len(self._buffer) > MAX_EVENT_BYTES:
            raise OversizedEvent(
                f"sent {len(self._buffer)} bytes without ending an event (at most "
                f"{MAX_EVENT_BYTES})"
            )
        return b"".join(self._patch(e) for e in events)

    def _patch(self, event: bytes) -> bytes:
        if not event.startswith(b"data: ") or event == b"data: [DONE]":
            return event + b"\n\n"
        try:
            data = json.loads(event[6:])
        except (ValueError, RecursionError):
            return event + b"\n\n"  # not ours to judge: the client sees it as sent
        if not isinstance(data, dict) or "error" in data:
            return event + b"\n\n"
        data["id"] = self._id
        choices = data.get("choices")
        for choice in choices if isinstance(choices, list) else ():
            if isinstance(choice, dict) and choice.get("prompt_token_ids") is not None:
                choice["prompt_token_ids"] = None  # the client had them with the first token
        usage = data.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            data["usage"] = dict(
                usage, **self._usage_of(usage["completion_tokens"] + len(self._first.token_ids))
            )
        return _event(data)

    def rest(self) -> bytes:
        """What is left of the decode's stream once it ended: an unterminated event."""
        rest, self._buffer = self._buffer, b""
        return rest


def _event(data: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


__all__ = [
    "FIELDS",
    "MAX_EVENT_BYTES",
    "First",
    "MalformedAnswer",
    "OversizedEvent",
    "Stitch",
    "decode_body",
    "eligible",
    "prefill_body",
]
