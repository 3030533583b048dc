"""Transport registry: name -> ``"module:Class"``, imported on first use.

A missing optional dependency becomes :class:`~kvbridge.errors.TransportUnavailableError`
with the command that fixes it (``pip install 'kvbridge[nixl]'``, the Debian packages
Mooncake links against, ...), never a bare ImportError traceback.

>>> sorted(available())
['loopback', 'mooncake', 'nixl']
>>> try:
...     create_transport("nixel", None, agent_name="a")
... except UnknownTransportError as err:
...     print(err)
unknown transport 'nixel' (fix: did you mean 'nixl'? choose one of: loopback, mooncake, nixl)
"""

from __future__ import annotations

import difflib
import importlib
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvbridge.errors import TransportUnavailableError, UnknownTransportError

if TYPE_CHECKING:
    from kvbridge.config import KVBridgeConfig
    from kvbridge.core.layout import MemoryKind
    from kvbridge.transports.common import TransportBase


@dataclass(frozen=True)
class TransportEntry:
    """How to load one transport and how to fix it when it does not load."""

    name: str
    target: str
    """``"package.module:ClassName"``; the class has ``from_config(agent_name, config, memory)``."""
    summary: str
    install: str
    """Fix for a missing Python package."""
    hints: tuple[tuple[str, str], ...] = field(default=())
    """``(regex on the ImportError text, fix)`` pairs, tried before ``install``."""

    def fix_for(self, exc: BaseException) -> str:
        text = f"{exc} {exc.__cause__ or ''}"
        for pattern, fix in self.hints:
            if re.search(pattern, text):
                return fix
        return self.install


_MOONCAKE_DEBS = "apt-get install -y libibverbs1 libnl-3-200 libnl-route-3-200"

_REGISTRY: dict[str, TransportEntry] = {}


def register_transport(entry: TransportEntry) -> None:
    """Add (or replace) a transport; third-party transports register this way."""
    _REGISTRY[entry.name] = entry


register_transport(
    TransportEntry(
        name="nixl",
        target="kvbridge.transports.nixl:NixlTransport",
        summary="NIXL agent (UCX): host or device memory, prepared descriptor lists",
        install="pip install 'kvbridge[nixl]'",
        hints=(
            (
                r"No NIXL backend found",
                "pip install 'kvbridge[nixl]' (it brings the nixl-cu12 / nixl-cu13 backends)",
            ),
        ),
    )
)
register_transport(
    TransportEntry(
        name="mooncake",
        target="kvbridge.transports.mooncake:MooncakeTransport",
        summary="Mooncake transfer engine: TCP, or RDMA where a device exists",
        install="pip install 'kvbridge[mooncake]'",
        hints=(
            (r"libibverbs|libnl-|librdmacm", _MOONCAKE_DEBS),
            (
                r"libcudart|libcuda\.so",
                (
                    "pip uninstall -y mooncake-transfer-engine && pip install "
                    "mooncake-transfer-engine-non-cuda"
                ),
            ),
        ),
    )
)
register_transport(
    TransportEntry(
        name="loopback",
        target="kvbridge.transports.loopback:LoopbackTransport",
        summary="in-process test double (memmove between transports of one process)",
        install="(part of kvbridge)",
    )
)


def available() -> list[str]:
    """Registered transport names (whether or not their dependencies are installed)."""
    return list(_REGISTRY)


def entry(name: str) -> TransportEntry:
    try:
        return _REGISTRY[name]
    except KeyError:
        choices = sorted(_REGISTRY)
        close = difflib.get_close_matches(name, choices, n=1)
        hint = f"did you mean '{close[0]}'? " if close else ""
        raise UnknownTransportError(
            f"unknown transport {name!r}", fix=f"{hint}choose one of: {', '.join(choices)}"
        ) from None


def load(name: str) -> type[TransportBase]:
    """Import and return the transport class, or raise with the fix."""
    e = entry(name)
    module_name, _, cls_name = e.target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise TransportUnavailableError(
            f"transport {name!r} cannot be imported: {exc}", fix=e.fix_for(exc)
        ) from exc
    return getattr(module, cls_name)


def create_transport(
    name: str, config: KVBridgeConfig | None, *, agent_name: str, memory: MemoryKind = "host"
) -> TransportBase:
    """Create transport ``name`` configured by ``config`` (defaults when None)."""
    cls = load(name)
    if config is None:
        from kvbridge.config import KVBridgeConfig

        config = KVBridgeConfig()
    return cls.from_config(agent_name, config, memory)  # type: ignore[attr-defined]


__all__ = ["TransportEntry", "available", "create_transport", "entry", "load", "register_transport"]
