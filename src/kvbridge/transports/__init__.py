"""Transports move registered memory between processes; see :mod:`.base` for the contract.

Backends are imported lazily through :mod:`.registry`; importing this package imports
neither NIXL nor Mooncake.
"""

from kvbridge.transports.base import DescTable, Notification, Registration, Transport, Xfer
from kvbridge.transports.registry import available, create_transport

__all__ = [
    "DescTable",
    "Notification",
    "Registration",
    "Transport",
    "Xfer",
    "available",
    "create_transport",
]
