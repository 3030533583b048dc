"""Message authentication with the shared ``secret`` (config): HMAC-SHA256 over
length-prefixed parts, so no two different part lists share a MAC.

Who uses it: the side channel (:mod:`kvbridge.runtime.sidechannel`, vLLM) and the SGLang
backend's messages (:mod:`kvbridge.adapters.sglang.messages`). Pure.

>>> a = mac(b"s3cret", b"id", b"payload")
>>> len(a), verify(b"s3cret", a, b"id", b"payload"), verify(b"other", a, b"id", b"payload")
(32, True, False)
>>> mac(b"k", b"ab", b"c") == mac(b"k", b"a", b"bc")
False
"""

from __future__ import annotations

import hashlib
import hmac

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


__all__ = ["MAC_BYTES", "mac", "verify"]
