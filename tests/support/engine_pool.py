"""Engine servers shared across test modules: one pool per pytest session.

A server costs 25-45 s of two cores to start (mostly imports), so modules that need the
same one (the colocated tiny Llama every vLLM test compares against, ...) share it. A
server is keyed by everything that makes two servers differ: the engine, the model, the
arguments and the environment. Who calls: a module-scoped fixture, once per module that
uses a pooled server (:meth:`EnginePool.lease`); the pool owns the servers and stops
them (:meth:`EnginePool.close`, at the end of the session).

Between users the pool checks the server is idle (``idle``, given with the lease: KV
usage back to its value when the server became ready, nothing in flight), so a test that
leaks fails its own module's teardown, not the next module. A server that is not idle,
or that died, is stopped and not handed out again. Leases are counted: the last
user's release leaves the server running, idle, for a later module (unless the caller
says no later one needs it: ``keep=False``), and at most ``keep_idle`` idle servers are
kept (the oldest released is stopped first) so that idle engines do not pile up in
memory.
"""

from __future__ import annotations

import contextlib
import logging
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

log = logging.getLogger(__name__)

S = TypeVar("S")


@dataclass
class _Entry(Generic[S]):
    server: S
    users: int = 0
    broken: bool = False


class EnginePool(Generic[S]):
    """Servers by key. ``alive(server)``: whether it still runs; ``stop(server)``."""

    def __init__(
        self, alive: Callable[[S], bool], stop: Callable[[S], None], keep_idle: int = 2
    ) -> None:
        self._alive = alive
        self._stop = stop
        self.keep_idle = keep_idle
        self._entries: dict[Hashable, _Entry[S]] = {}
        self._idle: OrderedDict[Hashable, None] = OrderedDict()
        """Keys of servers nobody leases, oldest release first."""
        self.created = 0
        """Servers made so far (a test of the pool reads it)."""

    def get(self, key: Hashable, make: Callable[[], S]) -> S:
        """The server for ``key``, leased (:meth:`release` it); a new one from ``make()``
        (not started: the caller starts it, with others of its own) if none runs."""
        entry = self._entries.get(key)
        if entry is not None and (entry.broken or not self._alive_or_new(entry.server)):
            self._drop(key)
            entry = None
        if entry is None:
            entry = self._entries[key] = _Entry(make())
            self.created += 1
        self._idle.pop(key, None)
        entry.users += 1
        return entry.server

    def release(
        self, key: Hashable, idle: Callable[[S], None] | None = None, keep: bool = True
    ) -> None:
        """A user is done with ``key``'s server. ``idle(server)`` raises (an
        ``AssertionError``) if the server is not back at rest: the server is then
        stopped and the error raised to the caller, whose teardown fails. ``keep=False``:
        no later user will come, stop it once idle (after the check)."""
        entry = self._entries[key]
        entry.users -= 1
        try:
            if idle is not None and self._alive(entry.server):
                idle(entry.server)
        except BaseException:
            entry.broken = True
            if entry.users == 0:
                self._drop(key)
            raise
        if entry.users == 0 and not keep:
            self._drop(key)
        elif entry.users == 0:
            self._idle[key] = None
            while len(self._idle) > self.keep_idle:
                oldest, _ = self._idle.popitem(last=False)
                self._drop(oldest)

    @contextlib.contextmanager
    def lease(
        self,
        key: Hashable,
        make: Callable[[], S],
        idle: Callable[[S], None] | None = None,
        keep: bool = True,
    ) -> Iterator[S]:
        """:meth:`get` and, on exit, :meth:`release` with ``idle`` and ``keep``."""
        server = self.get(key, make)
        try:
            yield server
        finally:
            self.release(key, idle, keep)

    def close(self) -> None:
        """Stop every server (end of the session)."""
        for key in list(self._entries):
            self._drop(key)

    def _alive_or_new(self, server: Any) -> bool:
        started = getattr(server, "started", True)
        return not started or self._alive(server)

    def _drop(self, key: Hashable) -> None:
        entry = self._entries.pop(key, None)
        self._idle.pop(key, None)
        if entry is not None:
            try:
                self._stop(entry.server)
            except Exception:  # a server that fails to stop must not stop the others
                log.exception("stopping pooled server %r failed", key)


__all__ = ["EnginePool"]
