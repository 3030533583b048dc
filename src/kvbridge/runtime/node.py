"""One kvbridge instance in one worker process: identity, transport, peers.

A :class:`Node` owns the transport, the registered KV cache (geometry and its slot table
prepared once) and the peers it has shaken hands with. The prefill-side sender and the
decode-side receiver are built on it. Engine adapters create one per worker, after the
KV cache is allocated, and close it at shutdown.

Handshake: the decode side calls :meth:`Node.connect` with a prefill instance's
side-channel address; ``Hello`` carries our identity, transport metadata and geometry,
``Welcome`` the same from the other side (the codec checks compatibility before either
is read). Both sides then add each other to the transport and prepare the other's slot
table once. A peer is identified by engine id, rank and a per-process *epoch*: a
restarted process is a new peer even on the same address. Two ``kv_both`` instances
shake hands once per direction; a handshake with a peer already known in that role
reuses its tables, and neither touches the connection, so transfers in flight between
the two go on.

Tensor parallelism: peers whose instances split the KV heads differently (one TP size
a multiple of the other) are paired at the handshake
(:func:`kvbridge.core.tp.pair_split`): both sides then address blocks as head ranges
(:meth:`~kvbridge.core.layout.CacheGeometry.part_table`) and :meth:`Node.plan` pairs
those; on the packed path (``data_path: packed``, implied by ``wire_dtype: fp8``) they
exchange the head range they pair on through their staging buffers instead (``Peer.heads``, any
layout). A model with state-space layers cuts both caches into the segments each pair of ranks
shares (``Peer.cut``: attention head ranges, and the heads, groups and channels of each state,
:mod:`kvbridge.core.states`), addressed per transfer (:meth:`Node.plan`). Pairings that
cannot work are refused naming the fix.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
import numpy as np

from kvbridge.config import KVBridgeConfig
from kvbridge.core.blocks import BlockTable
from kvbridge.core.layout import CacheGeometry
from kvbridge.core.plan import Cut, plan_blocks, plan_grouped, plan_parts
from kvbridge.core.states import StateLayout, state_prefill_ranks, state_segments
from kvbridge.core.tp import Split, check_pairing, pair_split, prefill_ranks
from kvbridge.errors import (
    ConfigError,
    IncompatiblePeerError,
    KVBridgeError,
    PlanError,
    TransportError,
    WireError,
)
from kvbridge.runtime.packed import PackedPath, slot_format, staging_descs
from kvbridge.runtime.peers import MAX_PEERS, PeerTable
from kvbridge.runtime.sidechannel import SideChannelClient
from kvbridge.runtime.stats import TransferStats
from kvbridge.transports.base import DescTable
from kvbridge.transports.common import TransportBase
from kvbridge.transports.registry import create_transport
from kvbridge.wire.auth import MAC_BYTES, STAMP_BYTES, ReplayGuard, mac, stamp, verify
from kvbridge.wire.codec import Codec
from kvbridge.wire.messages import Hello, Message, PeerId, Reply, Welcome
from kvbridge.wire.peer_compat import CompatInfo, settings_mismatch

log = logging.getLogger(__name__)


MAX_PEER_SLOTS = 1 << 26
"""Slots (one block of one layer plane) a peer's cache may claim: its slot table is built
and registered with the transport at the handshake, 24 bytes a slot here and more in the
transport (about 1.6 GB at the bound, some 3x the largest real caches' tables)."""

_SLOW_HANDSHAKE_S = 5.0
"""A handshake step logged as slow past this many seconds (a 60 s handshake was seen once in
CI, NIXL, equal TP sizes, cause unknown: the warning says which step took the time)."""


@dataclass(frozen=True)
class Peer:
    """A peer we shook hands with."""

    id: PeerId
    agent: str
    """Its transport peer id."""
    geometry: CacheGeometry
    table: DescTable | None
    """Its slot table, prepared once; None with ``cut``."""
    address: str | None = None
    """Its side-channel address, for peers we connected to."""
    staging: DescTable | None = None
    """Its staging buffer's slot table, prepared once (``wire_dtype: fp8``)."""
    split: Split | None = None
    """How our blocks pair with its blocks when its tensor-parallel split differs from
    ours (``table`` then holds its blocks cut into ``split.remote_parts`` pieces, except
    on the packed path, which moves head ranges through staging); None when both hold
    the same heads per rank and blocks move whole."""
    heads: tuple[int, int] | None = None
    """Packed path: our KV heads ``[first, end)`` that pair with its blocks (all of ours
    unless ``split``); ``staging`` is then cut into chunks of that many heads."""
    cut: Cut | None = None
    """With ``split``, for a model with state-space layers: the segments of each block
    our ranks exchange, addressed per transfer on both sides (no ``table``); None
    otherwise."""

    @property
    def fanout(self) -> int:
        """Prefill side: how many of its instance's ranks this rank sends each request to."""
        return 1 if self.split is None else self.split.fanout


class Node:
    """kvbridge's state in one worker process.

    Args:
        config: the kvbridge configuration.
        geometry: where this worker's KV cache lives (already allocated).
        compat: what peers must share with us (model, dtype, layout, ...).
        engine_id: the engine instance's id; ``rank``: the worker's rank in it.
        transport: an already-created transport (tests); default: from ``config``.
        planes: per layer its K and V planes (:func:`kvbridge.ops.kv_planes`); needed
            by the packed path (``config.packed``), which packs from and unpacks into
            them.
    """

    def __init__(
        self,
        config: KVBridgeConfig,
        geometry: CacheGeometry,
        compat: CompatInfo,
        engine_id: str,
        rank: int = 0,
        transport: TransportBase | None = None,
        planes: list | None = None,
        stats: TransferStats | None = None,
    ) -> None:
        self.config = config
        self.geometry = geometry
        self.stats = stats if stats is not None else TransferStats()
        """Where handshakes are counted (``peers_registered``, ``peers_replaced``): the
        endpoint's, which the adapter exports."""
        self.codec = Codec(compat)
        self._secret = config.secret.encode() if config.secret else None
        self.id = PeerId(engine_id=engine_id, epoch=uuid.uuid4().hex[:12], rank=rank)
        self.transport = transport or create_transport(
            config.transport,
            config,
            agent_name=f"{engine_id}-{self.id.epoch}-r{rank}",
            memory=geometry.memory,
        )
        try:
            self.transport.register(
                geometry.regions(), memory=geometry.memory, device=geometry.device
            )
            self.table = self.transport.prepare(geometry.slot_table(), memory=geometry.memory)
            self.packed: PackedPath | None = None
            if config.packed:
                if planes is None:
                    raise ConfigError(
                        "the packed data path (wire_dtype 'fp8', data_path 'packed') needs the "
                        "cache tensors, which this engine adapter does not pass",
                        key="data_path",
                        fix="use wire_dtype 'exact' and data_path 'direct'",
                    )
                self.packed = PackedPath(
                    geometry,
                    planes,
                    config.staging_mb,
                    self.transport,
                    fp8=config.wire_dtype == "fp8",
                    timeout_s=config.timeouts.transfer_s,
                )
        except Exception:
            self.transport.close()
            raise
        self.note_replays = ReplayGuard()
        """With a secret: notifications taken (:meth:`decode_note`), against replays."""
        self._client: SideChannelClient | None = None
        self._lock = threading.Lock()
        self._peers: PeerTable[tuple[str, int, str], Peer] = PeerTable(
            self.transport, self.stats.add, limit=MAX_PEERS
        )
        """Keyed by engine id, rank and epoch; the seat is the engine id and rank (a restart
        keeps it). Changed under ``_lock`` with the maps of handshakes below."""
        self._by_address: dict[str, Peer] = {}
        self._built: dict[tuple[tuple[str, int, str], bool], tuple[bytes, Peer]] = {}
        """Per peer and role (we prefill: True), the transport metadata its tables were
        prepared from: a handshake again with the same metadata reuses them."""
        self._connecting: dict[str, threading.Lock] = {}
        self._part_tables: dict[int, DescTable] = {1: self.table}
        self._tables_lock = threading.Lock()

    # --- identities ----------------------------------------------------------------------

    @staticmethod
    def _key(pid: PeerId) -> tuple[str, int, str]:
        return (pid.engine_id, pid.rank, pid.epoch)

    def knows(self, pid: PeerId) -> bool:
        return self._key(pid) in self._peers

    @property
    def num_peers(self) -> int:
        """Peers we keep a handshake with (a level; any thread)."""
        return len(self._peers)

    def peer(self, pid: PeerId) -> Peer | None:
        return self._peers.get(self._key(pid))

    def _hello(self, cls: type[Hello | Welcome]):
        return cls(
            peer=self.id,
            compat=self.codec.compat,
            transport=self.transport.name,
            transport_metadata=self.transport.metadata(),
            geometry=self.geometry,
            staging=None if self.packed is None else self.packed.info,
        )

    def _add(self, msg: Hello | Welcome, address: str | None, *, prefill: bool) -> Peer:
        mismatch = settings_mismatch(
            str(msg.peer), {"transport": self.transport.name}, {"transport": msg.transport}
        )
        if mismatch is not None:  # wire_dtype and data_path: in the compatibility hash
            raise mismatch
        spec, theirs = self.geometry.spec, msg.geometry.spec
        # their head count may differ (another TP split), their layout where it packs alike
        layout = (
            spec.layout if msg.compat.layout_key == self.codec.compat.layout_key else theirs.layout
        )
        if (
            msgspec.structs.replace(theirs, num_kv_heads=spec.num_kv_heads, layout=layout) != spec
            or theirs.num_kv_heads != msg.compat.num_kv_heads
        ):
            # the compat hash covers the rest of the spec; a mismatch means a hand-made frame
            raise IncompatiblePeerError(
                f"peer {msg.peer} sent a cache spec that contradicts its compatibility info"
            )
        self._admit(msg)
        # its metadata must not be a kept peer's: adding it would replace that peer
        agent = self.transport.peer_name(msg.transport_metadata)
        self._peers.check_agent(self._key(msg.peer), agent, msg.peer)
        split = self._split(msg, prefill)
        if msg.geometry.layer_bytes != self.geometry.layer_bytes and split is None:
            # the compat hash covers the state layers' shapes; a mismatch means a hand-made frame
            raise IncompatiblePeerError(
                f"peer {msg.peer} sent per-layer block sizes that contradict its compatibility info"
            )
        states = bool(msg.geometry.layer_bytes or self.geometry.layer_bytes)
        # an idle pairing moves nothing; the decode rank's other pairings check its states' sources
        cut = (
            self._cut(msg, split, prefill)
            if split is not None and not split.idle and states
            else None
        )
        if (self.packed is None) != (msg.staging is None):
            # the compat hash covers data_path; a mismatch here means a hand-made frame
            raise IncompatiblePeerError(
                f"peer {msg.peer} disagrees on packed transfers (staging buffer "
                f"{'missing' if msg.staging is None else 'unexpected'})"
            )
        if msg.staging is not None and msg.staging.slot_bytes != (
            want := slot_format(msg.geometry, self.packed.fp8).nbytes
        ):
            raise IncompatiblePeerError(
                f"peer {msg.peer} packs blocks into {msg.staging.slot_bytes}-byte slots, its cache "
                f"spec into {want}"
            )
        key = self._key(msg.peer)
        with self._lock:
            built = self._built.get((key, prefill))
        if built is not None and built[0] == msg.transport_metadata:
            # a second handshake in the same role: its tables stay, in use or not
            peer = dataclasses.replace(built[1], address=address)
        else:
            start = time.monotonic()
            peer = self._build(msg, address, split, cut, prefill)
            _warn_if_slow(
                start,
                "adding peer %s to the %s transport and preparing its tables",
                msg.peer,
                self.transport.name,
            )
        with self._lock:
            # a restart of a peer (same engine and rank, new epoch) replaces the old one, and
            # so does another peer now serving its side channel's address (vLLM draws a new
            # engine id at each start unless one is configured)
            prior = None if address is None else self._by_address.get(address)
            also = () if prior is None else (self._key(prior.id),)
            gone = self._peers.put(key, key[:2], peer, also=also)
            for old in gone:
                if old.address is not None and self._by_address.get(old.address) is old:
                    del self._by_address[old.address]
                self._unbuild(self._key(old.id))
            self._built[(key, prefill)] = (msg.transport_metadata, peer)
            if address is not None:
                self._by_address[address] = peer
        self._peers.retire(gone)
        log.info("kvbridge: %s shook hands with %s", self.id, msg.peer)
        return peer

    def _admit(self, msg: Hello | Welcome) -> None:
        """Refuse a handshake that would exceed :data:`MAX_PEERS` or whose cache claims
        more than :data:`MAX_PEER_SLOTS` slots, before anything is built for it."""
        if msg.geometry.num_slots > MAX_PEER_SLOTS:
            raise IncompatiblePeerError(
                f"peer {msg.peer} claims a cache of {msg.geometry.num_slots} slots (blocks x "
                f"layer planes), over the {MAX_PEER_SLOTS} kvbridge builds a table for",
                fix="check the peer's KV cache size; a real one is far smaller",
            )
        key = self._key(msg.peer)
        if self._peers.full_for(key, key[:2]):
            raise KVBridgeError(
                f"handshake from {msg.peer} refused: this worker already keeps "
                f"{self._peers.limit} peers",
                fix=(
                    "use fewer decode instances per prefill instance, or set a 'secret' so that "
                    "only your own instances can shake hands"
                ),
            )

    def _build(
        self,
        msg: Hello | Welcome,
        address: str | None,
        split: Split | None,
        cut: Cut | None,
        prefill: bool,
    ) -> Peer:
        """Add the peer to the transport and prepare its tables. The prefill side adds
        a peer while that peer waits for its ``Welcome`` (the side-channel handler):
        the transport must not wait on the peer then (a Mooncake TCP lane that stalls
        blocks a probe for ``transfer_s``, far past the peer's ``handshake_s``)."""
        agent = self.transport.add_peer(msg.transport_metadata, probe=not prefill)
        if cut is not None:  # both caches addressed segment by segment, per transfer
            return Peer(
                id=msg.peer,
                agent=agent,
                geometry=msg.geometry,
                table=None,
                address=address,
                split=split,
                cut=cut,
            )
        # the exact path moves head ranges of blocks
        parts = split is not None and self.packed is None
        table = self.transport.prepare(
            msg.geometry.part_table(split.remote_parts if parts else 1),
            memory=msg.geometry.memory,
            peer=agent,
        )
        if parts:
            self.local_table(split.local_parts)  # prepared once, before the first transfer
        staging = heads = None
        if msg.staging is not None:
            # packed: both sides cut their staging into chunks of the heads the pair moves
            num_heads = self.geometry.spec.num_kv_heads
            heads = (0, num_heads) if split is None or split.idle else split.local_heads(num_heads)
            chunk = self.packed.chunk(heads[1] - heads[0]).nbytes
            self.packed.table_for(heads[1] - heads[0])  # prepared once, before the first transfer
            staging = self.transport.prepare(
                staging_descs(msg.staging, chunk), memory=msg.staging.memory, peer=agent
            )
        return Peer(
            id=msg.peer,
            agent=agent,
            geometry=msg.geometry,
            table=table,
            address=address,
            staging=staging,
            split=split,
            heads=heads,
        )

    def _split(self, msg: Hello | Welcome, prefill: bool) -> Split | None:
        """How our blocks pair with the peer's when our TP splits differ (None: they do
        not); raises when they cannot be paired."""
        ours, theirs = self.codec.compat, msg.compat
        if (ours.tp_size, ours.num_kv_heads) == (theirs.tp_size, theirs.num_kv_heads):
            return None
        (p, p_rank), (d, d_rank) = (
            ((ours, self.id.rank), (theirs, msg.peer.rank))
            if prefill
            else ((theirs, msg.peer.rank), (ours, self.id.rank))
        )
        what = (
            f"prefill TP {p.tp_size} ({p.num_kv_heads} KV heads per rank), decode TP {d.tp_size} "
            f"({d.num_kv_heads} per rank)"
        )
        differences = {
            "tp_size": (ours.tp_size, theirs.tp_size),
            "num_kv_heads": (ours.num_kv_heads, theirs.num_kv_heads),
        }
        try:
            # the receiver tells idle prefill ranks to let go
            check_pairing(p.model_kv_heads, p.tp_size, d.tp_size, idle=True)
        except IncompatiblePeerError as exc:
            raise IncompatiblePeerError(exc.message, differences=differences, fix=exc.fix) from None
        if not self.geometry.spec.heads_apart and self.packed is None:
            raise IncompatiblePeerError(
                f"{what}: the KV cache layout {self.geometry.spec.layout} interleaves heads within "
                "a block, so a rank's heads cannot be cut out of it",
                differences=differences,
                fix=(
                    "use the same --tensor-parallel-size on both, an HND cache layout (vLLM: "
                    "VLLM_KV_CACHE_LAYOUT=HND), or the packed path on both (data_path 'packed', "
                    "exact values; or wire_dtype 'fp8'): it moves any head range"
                ),
            )
        split = pair_split(p.model_kv_heads, p.tp_size, d.tp_size, p_rank, d_rank, prefill=prefill)
        if split is None:
            raise IncompatiblePeerError(
                f"{what}: decode rank {d_rank} gets none of its KV heads from prefill rank "
                f"{p_rank}",
                differences=differences,
                fix=(
                    f"decode rank {d_rank} reads from prefill ranks "
                    f"{prefill_ranks(p.model_kv_heads, p.tp_size, d.tp_size, d_rank)}"
                ),
            )
        return split

    def _cut(self, msg: Hello | Welcome, split: Split, prefill: bool) -> Cut:
        """The segments of each block our rank and the peer's exchange when our TP splits
        differ and the model has state-space layers: head ranges of the attention layers'
        blocks (``split``), and the parts of each state that the two ranks share
        (:func:`~kvbridge.core.states.state_segments`); raises when kvbridge cannot
        tell how the states split, or when the decode rank would need states from a
        prefill rank that holds none of its attention heads. Once per handshake with
        such a peer. Transfers address the segments of their blocks alone
        (:meth:`plan`): a table of every block cut so would hold, per state layer, one
        descriptor per segment (with the ``SD`` conv order, rows x sub-projections) of
        every block, on both sides of every such pair."""
        ours, theirs = self.codec.compat, msg.compat
        (p, p_rank), (d, d_rank) = (
            ((ours, self.id.rank), (theirs, msg.peer.rank))
            if prefill
            else ((theirs, msg.peer.rank), (ours, self.id.rank))
        )
        differences = {"tp_size": (ours.tp_size, theirs.tp_size)}
        layouts = [StateLayout.decode(text) if text else None for text in ours.group_states]
        if (
            not any(layouts)
            or any(
                text and layout is None
                for text, layout in zip(ours.group_states, layouts, strict=True)
            )
            or self.geometry.spec.planes_per_layer != 1
        ):
            kinds = sorted(
                {
                    text.split(" ")[0]
                    for text, layout in zip(ours.group_states, layouts, strict=True)
                    if text and layout is None
                }
            )
            raise IncompatiblePeerError(
                f"peer {msg.peer} runs another tensor-parallel size ({theirs.tp_size} vs "
                f"{ours.tp_size}); kvbridge moves the states of "
                f"{', '.join(kinds) or 'these'} state-space layers between equal TP sizes only",
                differences=differences,
                fix="give prefill and decode the same --tensor-parallel-size for this model",
            )
        attention_ranks = set(prefill_ranks(p.model_kv_heads, p.tp_size, d.tp_size, d_rank))
        segments: dict[int, list[tuple[int, int, int]]] = {}
        for g, layout in enumerate(layouts):
            if layout is None:
                continue
            state_ranks = state_prefill_ranks(layout, p.tp_size, d.tp_size, d_rank)
            if not state_ranks <= attention_ranks:
                raise IncompatiblePeerError(
                    f"prefill TP {p.tp_size}, decode TP {d.tp_size}: decode rank {d_rank} would "
                    "need state-space states from prefill ranks "
                    f"{sorted(state_ranks - attention_ranks)}, which hold none of its attention KV "
                    "heads",
                    differences=differences,
                    fix="give prefill and decode the same --tensor-parallel-size for this model",
                )
            segs = state_segments(layout, p.tp_size, d.tp_size, p_rank, d_rank)
            segments[g] = segs if prefill else [(b, a, n) for a, b, n in segs]
            for geo, tp in ((self.geometry, ours.tp_size), (msg.geometry, theirs.tp_size)):
                if any(
                    geo.layer_block_bytes(layer) != layout.nbytes(tp)
                    for layer, of in enumerate(ours.layer_groups)
                    if of == g
                ):
                    raise IncompatiblePeerError(
                        f"peer {msg.peer}: a {layout.kind} state block does not hold the bytes its "
                        f"state layout says at TP {tp}"
                    )
        # the same on both sides (pair_split)
        piece = self.geometry.spec.block_bytes // split.local_parts
        heads = tuple((a * piece, b * piece, n * piece) for a, b, n in split.runs)
        cut = Cut([segments.get(g, heads) for g in ours.layer_groups])
        try:
            cut.check(self.geometry, remote=False)
            cut.check(msg.geometry, remote=True)
        except PlanError as exc:
            raise IncompatiblePeerError(f"peer {msg.peer}: {exc}") from None
        return cut

    def local_table(self, parts: int) -> DescTable:
        """Our slot table with every block cut into ``parts`` head ranges (1: whole
        blocks), prepared on first use and kept."""
        with self._tables_lock:  # held while preparing: each table is prepared once
            table = self._part_tables.get(parts)
            if table is None:
                table = self._part_tables[parts] = self.transport.prepare(
                    self.geometry.part_table(parts), memory=self.geometry.memory
                )
        return table

    def plan(
        self,
        peer: Peer,
        local_blocks: BlockTable | Sequence[int],
        remote_blocks: BlockTable | Sequence[int],
        layers: Sequence[int] | None = None,
        *,
        into_local: bool = False,
    ) -> tuple[DescTable, np.ndarray, DescTable, np.ndarray]:
        """Descriptor tables and indices moving ``local_blocks[i]`` to / from
        ``remote_blocks[i]`` in ``layers`` (default all): whole blocks, or the head
        ranges the peer's TP split pairs with ours. Block tables of several KV cache
        groups pair each layer's group (:func:`~kvbridge.core.plan.plan_grouped`),
        leaving out what the destination (the peer, or us when ``into_local``: a read)
        holds no block for. The indices may be empty: nothing of these layers and
        positions moves.

        Raises:
            PlanError: bad block ids or layers, or block tables that do not fit the
                cache's groups.
        """
        if peer.split is not None and self.packed is not None:
            raise KVBridgeError(
                "a peer with another TP split exchanges packed head ranges through staging, not "
                "cache blocks"
            )
        local_t, remote_t = BlockTable.of(local_blocks), BlockTable.of(remote_blocks)
        groups = self.codec.compat.layer_groups
        if peer.cut is not None:  # this transfer's segments, not a prepared table's
            ldescs, rdescs = plan_grouped(
                self.geometry,
                peer.geometry,
                local_t,
                remote_t,
                groups,
                layers,
                cut=peer.cut,
                into_local=into_local,
            )
            rows = np.arange(len(ldescs), dtype=np.int32)
            if not len(ldescs):  # nothing of these layers moves: empty lists (post refuses them)
                return (
                    DescTable(ldescs, self.geometry.memory, None, prepared=False),
                    rows,
                    DescTable(rdescs, peer.geometry.memory, peer.agent, prepared=False),
                    rows,
                )
            local = self.transport.adhoc(ldescs, memory=self.geometry.memory)
            return (
                local,
                rows,
                self.transport.adhoc(rdescs, memory=peer.geometry.memory, peer=peer.agent),
                rows,
            )
        table = self.table if peer.split is None else self.local_table(peer.split.local_parts)
        if groups or local_t.num_groups > 1 or remote_t.num_groups > 1:
            lidx, ridx = plan_grouped(
                self.geometry,
                peer.geometry,
                local_t,
                remote_t,
                groups,
                layers,
                split=peer.split,
                into_local=into_local,
            )
            return table, lidx, peer.table, ridx
        local_ids, remote_ids = local_t.row(0), remote_t.row(0)
        if peer.split is None:
            plan = plan_blocks(self.geometry, peer.geometry, local_ids, remote_ids, layers=layers)
        else:
            plan = plan_parts(
                self.geometry, peer.geometry, local_ids, remote_ids, peer.split, layers=layers
            )
        return table, plan.local_slots, peer.table, plan.remote_slots

    # --- notifications -------------------------------------------------------------------

    def encode_note(self, msg: Message, to: str) -> bytes:
        """The payload of a transport notification (``LayerDone``, ``Done``) for the peer
        whose agent is ``to``: the codec's frame, followed, when a ``secret`` is set
        (notifications travel outside the side channel, on the transport), by a time
        stamp and a MAC over our agent and ``to``'s, the stamp and the frame, so that it
        is refused by any other receiver, as from any other sender, later, and again
        (:meth:`decode_note`). Any thread."""
        frame = self.codec.encode(msg)
        if self._secret is None:
            return frame
        when = stamp()
        agents = (self.transport.agent_name.encode(), to.encode())
        return frame + when + mac(self._secret, b"note", *agents, when, frame)

    def decode_note(self, payload: bytes, sender: str) -> Message:
        """Inverse of :meth:`encode_note`, for a notification the transport says came
        from the agent ``sender``. Raises :class:`~kvbridge.errors.WireError` for a
        payload that fails authentication (another secret, sender or receiver), is stale
        or replayed, is malformed, or comes from an incompatible peer. One thread (the
        receiver's notification thread)."""
        if self._secret is not None:
            signed = STAMP_BYTES + MAC_BYTES
            frame, when, tag = payload[:-signed], payload[-signed:-MAC_BYTES], payload[-MAC_BYTES:]
            agents = (sender.encode(), self.transport.agent_name.encode())
            if len(payload) <= signed or not verify(
                self._secret, tag, b"note", *agents, when, frame
            ):
                raise WireError(
                    "a notification failed authentication",
                    fix="set the same 'secret' on prefill and decode",
                )
            why = self.note_replays.check(tag, when)
            if why is not None:
                raise WireError(f"a notification was refused: {why}")
            payload = frame
        return self.codec.decode(payload)

    # --- server side ---------------------------------------------------------------------

    def welcome(self, hello: Hello) -> Welcome:
        """Answer a ``Hello`` (side-channel handler, prefill side)."""
        self._add(hello, None, prefill=True)
        start = time.monotonic()
        welcome = self._hello(Welcome)
        _warn_if_slow(start, "writing the Welcome for %s (our transport metadata)", hello.peer)
        return welcome

    # --- client side ---------------------------------------------------------------------

    @property
    def client(self) -> SideChannelClient:
        with self._lock:
            if self._client is None:
                self._client = SideChannelClient(self.codec, self.config.secret)
            return self._client

    def connect(self, address: str, *, epoch: str | None = None, fresh: bool = False) -> Peer:
        """The peer serving ``address``, shaking hands first if needed (bounded by
        ``timeouts.handshake_s``). ``epoch``: the epoch the caller expects (e.g. from
        ``kv_transfer_params``); a different one raises. ``fresh``: forget the cached
        handshake (the peer said it does not know us: it restarted)."""
        with self._lock:
            gate = self._connecting.setdefault(address, threading.Lock())
        start = time.monotonic()
        with gate:  # one handshake per address at a time
            with self._lock:
                peer = None if fresh else self._by_address.get(address)
            if peer is None:
                asked = time.monotonic()
                reply = self.client.request(
                    address, self._hello(Hello), self.config.timeouts.handshake_s
                )
                answered = time.monotonic()
                if isinstance(reply, Reply):
                    raise KVBridgeError(
                        f"handshake with {address} refused: {reply.detail or reply.code}"
                    )
                if not isinstance(reply, Welcome):
                    raise TransportError(
                        f"handshake with {address}: unexpected {type(reply).__name__}"
                    )
                peer = self._add(reply, address, prefill=False)
                steps = (asked - start, answered - asked, time.monotonic() - answered)
                if sum(steps) > _SLOW_HANDSHAKE_S:
                    log.warning(
                        "kvbridge: the handshake with %s took %.1f s: %.1f s waiting for another "
                        "handshake with it, %.1f s for its reply, %.1f s adding it",
                        address,
                        sum(steps),
                        *steps,
                    )
        if epoch is not None and peer.id.epoch != epoch:
            raise KVBridgeError(
                f"the prefill instance at {address} restarted (epoch {peer.id.epoch}, expected "
                f"{epoch}); the KV it held is gone",
            )
        return peer

    def forget(self, address: str, *, unless_epoch: str | None = None) -> None:
        """Drop the cached handshake with ``address`` (the peer died or restarted), unless
        it is with ``unless_epoch`` (the instance that serves the address now: transfers
        of that epoch use it)."""
        with self._lock:
            peer = self._by_address.get(address)
            if peer is None or (unless_epoch is not None and peer.id.epoch == unless_epoch):
                return
            del self._by_address[address]
            self._peers.pop(self._key(peer.id))
            self._unbuild(self._key(peer.id))
        if unless_epoch is not None:  # another instance serves its address: a restart
            self.stats.add(peers_replaced=1)
        self._peers.retire([peer])

    def _unbuild(self, key: tuple[str, int, str]) -> None:
        """Forget what was built for peer ``key`` in both roles (caller holds ``_lock``)."""
        for role in (True, False):
            self._built.pop((key, role), None)

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()
        self.transport.close()


def _warn_if_slow(start: float, what: str, *args: object) -> None:
    """Log ``what`` as slow if it began at ``start`` (monotonic) over ``_SLOW_HANDSHAKE_S`` ago."""
    took = time.monotonic() - start
    if took > _SLOW_HANDSHAKE_S:
        log.warning("kvbridge: %s took %.1f s", what % args, took)


__all__ = ["Node", "Peer"]
