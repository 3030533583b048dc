"""Message authentication with the shared ``secret`` (config): HMAC-SHA256 over
length-prefixed parts, so no two different part lists share a MAC.

Who uses it: the side channel (:mod:`kvbridge.runtime.sidechannel`) and the transport
notifications (:class:`kvbridge.runtime.node.Node`) of the vLLM path, and the SGLang
backend's messages (:mod:`kvbridge.adapters.sglang.messages`). Pure.

>>> a = mac(b"s3cret", b"id", b"payload")
>>> len(a), verify(b"s3cret", a, b"id", b"payload"), verify(b"other", a, b"id", b"payload")
(32, True, False)
>>> mac(b"k", b"ab", b"c") == mac(b"k", b"a", b"bc")
False
>>> sealed = seal(b"k", b"msg", b"note")
>>> unseal(b"k", sealed, b"note"), unseal(b"k", sealed), unseal(b"x", sealed, b"note")
(b'msg', None, None)
>>> seal(None, b"msg") == unseal(None, b"msg") == b"msg"
True
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

MAC_BYTES = 32


def mac(secret: bytes, *parts: bytes) -> bytes:
    """The MAC of ``parts`` under ``secret`` (:data:`MAC_BYTES` bytes)."""
    h = hmac.new(secret, digestmod=hashlib.sha256)
    for p in parts:
        h.update(len(p).to_bytes(8, "little"))
        h.update(p)
    return h.digest()


def verify(secret: bytes, tag: bytes, *parts: bytes) -> bool:
    """Whether ``tag`` is the MAC of ``parts`` under ``secret`` (constant time)."""
    return hmac.compare_digest(tag, mac(secret, *parts))


def seal(secret: bytes | None, payload: bytes, *context: bytes) -> bytes:
    """``payload`` followed by its MAC (over ``context`` and ``payload``) under
    ``secret``: a single-part message, e.g. a transport notification. Without a secret,
    ``payload`` unchanged."""
    return payload if secret is None else payload + mac(secret, *context, payload)


def unseal(secret: bytes | None, data: bytes, *context: bytes) -> bytes | None:
    """The payload of :func:`seal`'s output with the same ``secret`` and ``context``, or
    None when its MAC is missing or does not verify. Without a secret, ``data``."""
    if secret is None:
        return data
    payload, tag = data[:-MAC_BYTES], data[-MAC_BYTES:]
    return payload if len(data) > MAC_BYTES and verify(secret, tag, *context, payload) else None


def new_ticket() -> str:
    """An unguessable token for one transfer (128 random bits, URL-safe text): whoever
    presents it took part in the transfer's handoff (:class:`kvbridge.wire.messages.Abort`)."""
    return secrets.token_urlsafe(16)


__all__ = ["MAC_BYTES", "mac", "new_ticket", "seal", "unseal", "verify"]
