"""The kvbridge exception tree.

Every error kvbridge raises on purpose is a :class:`KVBridgeError`. Each carries a
human-readable message saying what went wrong and, where one exists, a ``fix``: the
action that makes the error go away (a config key to change, a package to install).
``str(err)`` includes the fix, so a log line alone is enough to act on.

Backend exceptions (NIXL, Mooncake, msgspec) never cross a kvbridge API boundary: the
module that calls the backend maps them to one of these types and chains the original
as ``__cause__``.

This module imports nothing from kvbridge; everything else may import it.
"""

from __future__ import annotations


class KVBridgeError(Exception):
    """Base of all kvbridge errors.

    Args:
        message: what went wrong, in terms of the caller's inputs.
        fix: what to do about it; appended to ``str(err)`` when given.
    """

    def __init__(self, message: str, *, fix: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.fix = fix

    def __str__(self) -> str:
        if self.fix:
            return f"{self.message} (fix: {self.fix})"
        return self.message


# --- configuration -----------------------------------------------------------------------


class ConfigError(KVBridgeError, ValueError):
    """User configuration is malformed: an unknown key, a wrong type, a value out of range.

    ``key`` is the dotted path of the offending key (``"nixl.backends"``), or ``None``
    when the whole document is unreadable.
    """

    def __init__(self, message: str, *, key: str | None = None, fix: str | None = None) -> None:
        super().__init__(message, fix=fix)
        self.key = key


class PlanError(KVBridgeError, ValueError):
    """A transfer cannot be planned: the two caches differ in spec, block lists differ in
    length, or a block id or layer is out of range."""


# --- wire / peers ------------------------------------------------------------------------


class WireError(KVBridgeError):
    """A message from the network failed to decode or validate.

    Nothing from the network is trusted: this is raised instead of acting on a frame
    that is truncated, of the wrong type, or carries unexpected fields.
    """


class ProtocolVersionError(WireError):
    """The peer speaks a kvbridge wire protocol version this build cannot read."""


class IncompatiblePeerError(WireError):
    """The peer's KV cache cannot be exchanged with ours (model, dtype, layout, ...).

    ``differences`` maps each differing property to ``(ours, theirs)``; it may be empty
    when the peer sent only a hash.
    """

    def __init__(
        self,
        message: str,
        *,
        differences: dict[str, tuple[object, object]] | None = None,
        fix: str | None = None,
    ) -> None:
        super().__init__(message, fix=fix)
        self.differences = dict(differences or {})


# --- transports --------------------------------------------------------------------------


class TransportError(KVBridgeError):
    """A transport operation failed. Subclasses say whether the peer, the input or the
    local backend is at fault."""


class TransportUnavailableError(TransportError):
    """The transport's backend cannot be used here: its package is missing, a native
    library is absent, or the requested hardware (RDMA, CUDA) is not present."""


class UnknownTransportError(TransportError, ConfigError):
    """A transport name that is not registered."""

    def __init__(self, message: str, *, fix: str | None = None) -> None:
        TransportError.__init__(self, message, fix=fix)
        self.key = "transport"


class UnknownPeerError(TransportError):
    """A peer id that was never added (or was removed) was used."""


class InvalidDescriptorError(TransportError, ValueError):
    """A descriptor points outside any registered memory region, or a descriptor list is
    malformed (wrong shape, negative length, index out of range)."""


class PeerUnreachableError(TransportError):
    """The peer could not be contacted at all (connection refused, no route)."""


class PeerDisconnectedError(TransportError):
    """The peer went away while a transfer was in flight, or is no longer reachable."""


class TransferFailedError(TransportError):
    """The backend reported a failed transfer without a more specific cause."""


# --- deadlines and request lifecycle -----------------------------------------------------


class DeadlineExceeded(KVBridgeError, TimeoutError):
    """A bounded wait ran out: a transfer, a handshake, a notification, a lease."""


class RequestAborted(KVBridgeError):
    """The request was aborted (by the engine, the client, or the peer)."""


class StateError(KVBridgeError, RuntimeError):
    """An illegal state transition was requested. This is a bug in the caller (or in
    kvbridge), never a consequence of network input."""


__all__ = [
    "ConfigError",
    "DeadlineExceeded",
    "IncompatiblePeerError",
    "InvalidDescriptorError",
    "KVBridgeError",
    "PeerDisconnectedError",
    "PeerUnreachableError",
    "PlanError",
    "ProtocolVersionError",
    "RequestAborted",
    "StateError",
    "TransferFailedError",
    "TransportError",
    "TransportUnavailableError",
    "UnknownPeerError",
    "UnknownTransportError",
    "WireError",
]
