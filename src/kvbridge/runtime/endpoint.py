"""What an engine adapter creates per worker: node, sender/receiver, side channel.

A prefill worker gets a :class:`~kvbridge.runtime.sender.Sender` and serves the side
channel (decode workers connect to it); a decode worker gets a
:class:`~kvbridge.runtime.receiver.Receiver`; a worker doing both gets both. The
adapter calls the sender/receiver from its engine hooks and :meth:`Endpoint.close` at
shutdown (which releases everything, idempotently).
"""

from __future__ import annotations

import logging
import threading

from kvbridge.config import KVBridgeConfig, exposure_warning
from kvbridge.core.layout import CacheGeometry
from kvbridge.runtime.node import Node
from kvbridge.runtime.receiver import Receiver
from kvbridge.runtime.sender import Sender
from kvbridge.runtime.sidechannel import SideChannelServer
from kvbridge.runtime.stats import TransferStats
from kvbridge.transports.common import TransportBase
from kvbridge.wire.messages import Abort, Destination, Heartbeat, Hello, Message, Release, Reply
from kvbridge.wire.peer_compat import CompatInfo

log = logging.getLogger(__name__)


class Endpoint:
    """kvbridge in one worker process.

    Args:
        send: this worker prefills for others (serves the side channel).
        receive: this worker decodes with KV from others.
        transport: an already-created transport (tests); default: from ``config``.
        planes: per layer its K and V planes, for the packed path (``config.packed``) (see
            :class:`~kvbridge.runtime.node.Node`).
    """

    def __init__(
        self,
        config: KVBridgeConfig,
        geometry: CacheGeometry,
        compat: CompatInfo,
        engine_id: str,
        rank: int = 0,
        *,
        send: bool,
        receive: bool,
        transport: TransportBase | None = None,
        planes: list | None = None,
    ) -> None:
        self.config = config
        self.stats = TransferStats()
        self.node = Node(
            config,
            geometry,
            compat,
            engine_id,
            rank,
            transport=transport,
            planes=planes,
            stats=self.stats,
        )
        self.activity = threading.Event()
        """Set whenever the sender released or the receiver finished something; the
        adapter clears it when it takes them (and may wait on it in between)."""
        self.sender: Sender | None = None
        self.receiver: Receiver | None = None
        self.server: SideChannelServer | None = None
        try:
            if send:
                if (warning := exposure_warning(config)) is not None and rank == 0:
                    log.warning("%s", warning)
                self.sender = Sender(self.node, self.stats, on_outcome=self.activity.set)
                port = config.side_channel_port + rank if config.side_channel_port else 0
                self.server = SideChannelServer(
                    self.node.codec,
                    config.host,
                    port,
                    self._handle,
                    config.secret,
                    on_refused=lambda: self.stats.add(messages_refused=1),
                )
            if receive:
                self.receiver = Receiver(self.node, self.stats, on_outcome=self.activity.set)
        except Exception:
            self.close()
            raise

    @property
    def address(self) -> str | None:
        """Side-channel address decode workers connect to (prefill workers only)."""
        return None if self.server is None else self.server.address

    @property
    def epoch(self) -> str:
        return self.node.id.epoch

    def _handle(self, msg: Message) -> Message:
        if isinstance(msg, Hello):
            return self.node.welcome(msg)
        if isinstance(msg, Heartbeat):
            return Reply(ok=True, epoch=self.epoch)
        if isinstance(msg, (Destination, Release, Abort)):
            if not self.node.knows(msg.peer):
                return Reply(
                    ok=False,
                    code="unknown_peer",
                    detail="no handshake with you: say Hello",
                    epoch=self.epoch,
                )
            assert self.sender is not None
            if isinstance(msg, Destination):
                return self.sender.on_destination(msg)
            if isinstance(msg, Release):
                return self.sender.on_release(msg)
            return self.sender.on_abort(msg)
        return Reply(
            ok=False,
            code="error",
            detail=f"unexpected {type(msg).__name__} on the side channel",
            epoch=self.epoch,
        )

    def close(self) -> None:
        """Stop serving, stop the sender/receiver, release the transport. Idempotent."""
        for part in (self.server, self.sender, self.receiver):
            if part is not None:
                try:
                    part.close()
                except Exception:
                    log.warning("kvbridge: closing %s failed", type(part).__name__, exc_info=True)
        self.node.close()


__all__ = ["Endpoint"]
