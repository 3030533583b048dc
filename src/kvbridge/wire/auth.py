"""Message authentication with the shared ``secret`` (config): HMAC-SHA256 over
length-prefixed parts, so no two different part lists share a MAC.

Who uses it: the side channel (:mod:`kvbridge.runtime.sidechannel`) and the transport
notifications (:class:`kvbridge.runtime.node.Node`) of the vLLM path, and the SGLang
backend's messages (:mod:`kvbridge.wire.room_messages`). Pure.

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

Freshness: a MAC'd message carries a :func:`stamp` (inside what its MAC covers), and its
receiver keeps a :class:`ReplayGuard`, which refuses a stamp too far from its clock and a
MAC it has seen before:

>>> guard = ReplayGuard(clock=lambda: 1000.0)
>>> now = stamp(1000.0)
>>> guard.check(b"tag-1", now) is None, guard.check(b"tag-1", now)
(True, 'the message was replayed')
>>> guard.check(b"tag-2", stamp(1000.0 - 2 * FRESH_S)) is not None
True
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable

MAC_BYTES = 32
STAMP_BYTES = 8

FRESH_S = 60.0
"""A message stamped further than this from its receiver's clock is refused (stale, or
the two machines' clocks disagree)."""

REPLAY_CAPACITY = 1 << 18
"""MACs a :class:`ReplayGuard` remembers, each for ``2 * FRESH_S`` (only a holder of the
secret adds to it); past this many the oldest are forgotten first (about 20 MB)."""


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


def stamp(now: float | None = None) -> bytes:
    """A time stamp for a MAC'd message: milliseconds of the wall clock, 8 bytes."""
    return int((time.time() if now is None else now) * 1000).to_bytes(STAMP_BYTES, "big")


class ReplayGuard:
    """What one receiver remembers to refuse stale and replayed authenticated messages.

    :meth:`check` is called after a message's MAC verified (so only a holder of the
    secret fills it), with the MAC and the stamp the MAC covers. Bounded:
    :data:`REPLAY_CAPACITY` entries, each forgotten ``2 * fresh_s`` after it was seen
    (by then its stamp is stale anyway). Thread-safe under the GIL for one caller
    thread; a receiver with several threads holds its own lock around it.
    """

    def __init__(
        self,
        fresh_s: float = FRESH_S,
        capacity: int = REPLAY_CAPACITY,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.fresh_s = fresh_s
        self.capacity = capacity
        self._clock = clock
        self._seen: OrderedDict[bytes, float] = OrderedDict()
        """MAC -> when it is forgotten (oldest first)."""

    def check(self, tag: bytes, when: bytes) -> str | None:
        """None when the message is fresh and new (it is remembered then); else why not."""
        if len(when) != STAMP_BYTES:
            return "the message carries no time stamp"
        now = self._clock()
        if abs(now - int.from_bytes(when, "big") / 1000) > self.fresh_s:
            return (
                f"the message is stamped more than {self.fresh_s:g} s from this receiver's clock "
                "(a replay, or the machines' clocks disagree: sync them)"
            )
        while self._seen and next(iter(self._seen.values())) < now:
            self._seen.popitem(last=False)
        if tag in self._seen:
            return "the message was replayed"
        self._seen[tag] = now + 2 * self.fresh_s
        if len(self._seen) > self.capacity:
            self._seen.popitem(last=False)
        return None

    def __len__(self) -> int:
        return len(self._seen)


def new_ticket() -> str:
    """An unguessable token for one transfer (128 random bits, URL-safe text): whoever
    presents it took part in the transfer's handoff (:class:`kvbridge.wire.messages.Abort`)."""
    return secrets.token_urlsafe(16)


__all__ = [
    "FRESH_S",
    "MAC_BYTES",
    "REPLAY_CAPACITY",
    "STAMP_BYTES",
    "ReplayGuard",
    "mac",
    "new_ticket",
    "seal",
    "stamp",
    "unseal",
    "verify",
]
