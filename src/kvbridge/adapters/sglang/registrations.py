"""Decode ranks' registrations at an SGLang prefill rank: checked, prepared, kept.

A decode rank registers once with each prefill rank it reads from (a
:class:`~kvbridge.wire.room_messages.Registration` on the prefill's control socket).
:class:`Registrations` checks it against this rank (:class:`PrefillRank`: settings both
sides share, then the compatibility hash, then pages, sliding windows, state-space
layers and the TP pairing), prepares its buffers as transport descriptor tables and
keeps it in the rank's :class:`~kvbridge.runtime.peers.PeerTable` (a restarted decode
rank replaces its old agent by seat). A refused registration is remembered with its
reason: that decode's rooms then fail with it.

Who calls what: the prefill's control thread calls :meth:`Registrations.register` (the
only writer); the transfer thread and the control thread read :attr:`peers` (a
:class:`DecodePeer` per decode rank). Owner: the prefill side of the manager
(:class:`~.prefill.PrefillSide`), one per rank.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec

from kvbridge.adapters.sglang.packed import Part, latent_sources, room_part
from kvbridge.adapters.sglang.pools import check_windows, pages_differ
from kvbridge.adapters.sglang.states import Segment, check_states, state_cut
from kvbridge.core.layout import CacheGeometry
from kvbridge.core.rows import RowLayout, paired_count
from kvbridge.core.tp import heads_per_rank, prefill_ranks
from kvbridge.errors import IncompatiblePeerError
from kvbridge.runtime.node import MAX_PEER_SLOTS
from kvbridge.runtime.packed import staging_descs
from kvbridge.runtime.peers import MAX_PEERS, PeerTable
from kvbridge.wire import room_messages as wire
from kvbridge.wire.codec import UNDISCLOSED, incompatible
from kvbridge.wire.peer_compat import CompatInfo, compat_hash, hashed_diff, settings_mismatch

if TYPE_CHECKING:
    from kvbridge.runtime.packed import PackedPath
    from kvbridge.transports.base import DescTable, Transport

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class PrefillRank:
    """This prefill rank, as a registration is checked against it: built once by the
    manager when its pools are registered (:meth:`.prefill.PrefillSide._init_prefill`)."""

    transport: str
    wire_dtype: str
    data_path: str
    """The settings both sides must share (``KVBridgeConfig``'s, resolved)."""
    compat: CompatInfo
    """What the decode's ``Registration.compat`` must hash alike."""
    disclose: bool = False
    """Whether an error may show this prefill's values: only to authenticated peers (a
    ``secret``), since the text travels to the decode as its rooms' failure reason."""
    page_size: int
    """SGLang's page (tokens): a decode's radix-cache hits must end on one."""
    geometry: CacheGeometry
    packed: PackedPath | None = None
    """The packed data path's staging (None: the direct path)."""
    window_geometry: CacheGeometry | None = None
    state_layout: RowLayout | None = None
    state_split: object = None
    """:func:`.states.state_split` of a pool with state-space layers, or None."""
    aux_layout: RowLayout
    tp_size: int = 1
    tp_rank: int = 0
    """Attention TP."""
    total_kv_heads: int = 0
    """The model's KV heads over every rank (1 for MLA; 0 unknown)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class DecodePeer:
    """A registered decode rank, as this prefill rank writes to it: built once per
    :class:`~kvbridge.wire.room_messages.Registration` (the decode's buffers prepared
    as transport descriptor tables), read by the transfer thread, dropped with the
    peer."""

    agent: str
    """The decode rank at the transport: the agent its transport metadata names, which
    is its registration's, the key it is kept under (:meth:`Registrations.check_agent`)."""
    kv: DescTable
    """The decode's KV slots."""
    aux: DescTable
    """The decode's metadata rows."""
    geometry: CacheGeometry
    aux_layout: RowLayout
    aux_count: int
    """Metadata buffers both sides have (:func:`kvbridge.core.rows.paired_count`)."""
    staging: DescTable | None = None
    """Packed path: the decode's staging, in chunks of ``part.heads``."""
    part: Part | None = None
    """Packed path: the heads this rank moves to the decode rank."""
    window: DescTable | None = None
    """Sliding-window pool: the decode's window pages."""
    window_geometry: CacheGeometry | None = None
    """Sliding-window pool: the decode's window layers' pages."""
    states: DescTable | None = None
    """State-space layers: the decode's state rows."""
    state_layout: RowLayout | None = None
    """State-space layers: the decode's state tensors."""
    state_cut: tuple[tuple[Segment, ...], ...] | None = None
    """State-space layers, another attention TP size: per state tensor, the segments of a
    slot's row this rank writes into the decode rank's (:func:`.states.state_cut`);
    ``states`` is then None (each room's segments are posted as they are)."""
    seat: str = ""
    """Which rank of which decode server (``Registration.seat``)."""
    control: tuple[str, int] = ("", 0)
    """The decode rank's control socket (``Registration.ip``, ``port``): its destinations
    must name it (statuses and abort acknowledgements go there)."""

    @property
    def server(self) -> str:
        """The decode server this rank belongs to (its seat's address; an older decode
        without a seat: its control socket's host)."""
        return self.seat.split(" ")[0] if self.seat else self.control[0]


def _rows(layout: RowLayout | None) -> int:
    """Descriptors of a peer's metadata or state buffers (a row of each buffer each)."""
    return 0 if layout is None else len(layout.ptrs) * max(0, int(layout.rows))


class Registrations:
    """Registered and refused decode ranks of one prefill rank (see the module).

    Args:
        rank: this prefill rank.
        transport: its transport (peers added, tables prepared).
        count: where registrations are counted (``peers_registered``,
            ``peers_replaced``: the manager's metrics).
        check_aux: SGLang's check of a decode with another number of metadata buffers
            (``CommonKVManager.check_peer_aux_buffer_count``): called with the decode's
            agent and its count when they differ.
    """

    def __init__(
        self,
        rank: PrefillRank,
        transport: Transport,
        count: Callable[..., None],
        check_aux: Callable[[str, int], None],
    ) -> None:
        self.rank = rank
        self._transport = transport
        self._check_aux = check_aux
        self.peers: PeerTable[str, DecodePeer] = PeerTable(transport, count)
        """Registered decode ranks by agent, each in its ``Registration.seat``."""
        self.refused: dict[str, str] = {}
        """Decode agent -> why its registration was refused (the last :data:`MAX_PEERS`)."""

    def register(self, reg: wire.Registration) -> None:
        """Check a decode rank's registration and keep it, or remember why it was
        refused (logged; never raises for a bad registration). A second registration of
        a kept agent changes nothing, nor is it checked: a refusal recorded under a kept
        agent would fail all its rooms. Control thread only (the one writer)."""
        if reg.agent in self.peers:  # only this thread adds peers
            return
        try:
            self.check_agent(reg)
            part = self.pairing(reg)
            cut = self.state_cut(reg)
            self.admit(reg)
        except IncompatiblePeerError as exc:
            log.error("kvbridge: refused decode %s: %s", reg.agent, exc)
            self.refused[reg.agent] = str(exc)
            while len(self.refused) > MAX_PEERS:  # the oldest refusals are forgotten
                self.refused.pop(next(iter(self.refused)))
            return
        # No waiting probe: this is the control thread, which every room's destination
        # also passes through; a decode that does not answer shows at its first write.
        agent = self._transport.add_peer(reg.transport_md, probe=False)
        kv = self._transport.prepare(
            reg.geometry.slot_table(), memory=reg.geometry.memory, peer=agent
        )
        aux = self._transport.prepare(reg.aux.table(), memory="host", peer=agent)
        staging = None
        if part is not None:
            chunks = staging_descs(reg.staging, self.rank.packed.chunk(part.heads).nbytes)
            staging = self._transport.prepare(chunks, memory=reg.staging.memory, peer=agent)
        window = None
        if reg.window is not None:
            window = self._transport.prepare(
                reg.window.slot_table(), memory=reg.window.memory, peer=agent
            )
        states = None
        if reg.states is not None and cut is None:
            states = self._transport.prepare(
                reg.states.table(reg.geometry.device), memory=reg.geometry.memory, peer=agent
            )
        count = paired_count(self.rank.aux_layout, reg.aux)
        if count != len(self.rank.aux_layout.ptrs) or count != len(reg.aux.ptrs):
            self._check_aux(reg.agent, len(reg.aux.ptrs))
        peer = DecodePeer(
            agent=agent,
            kv=kv,
            aux=aux,
            geometry=reg.geometry,
            aux_layout=reg.aux,
            aux_count=count,
            staging=staging,
            part=part,
            window=window,
            window_geometry=reg.window,
            states=states,
            state_layout=reg.states,
            state_cut=cut,
            seat=reg.seat,
            control=(reg.ip, reg.port),
        )
        # A restarted decode rank (same seat, new agent) replaces its old agent; the ranks
        # of other decode servers, and of other DP replicas, stay.
        gone = self.peers.put(reg.agent, reg.seat or None, peer)
        self.peers.retire(gone)
        for old in gone:
            log.info(
                "kvbridge: decode peer %s replaced by %s (restarted: %s)",
                old.agent,
                reg.agent,
                reg.seat,
            )
        log.info("kvbridge: registered decode peer %s (epoch %s)", reg.agent, reg.epoch)

    def check_agent(self, reg: wire.Registration) -> None:
        """Refuse a registration whose transport metadata names another agent than the
        registration's: adding it would replace that agent's peer (its tables released)
        and file this decode's rooms under another's name."""
        agent = self._transport.peer_name(reg.transport_md)
        if agent != reg.agent:
            raise IncompatiblePeerError(
                f"decode {reg.agent} sent the transport metadata of agent {agent!r}: refused",
                fix=(
                    "register with this rank's own transport metadata; a decode that sends "
                    "another's is hostile: set a 'secret'"
                ),
            )

    def admit(self, reg: wire.Registration) -> None:
        """Refuse a registration beyond the peer table's limit of decode ranks
        (:data:`~kvbridge.runtime.peers.MAX_PEERS`; one from a seat already registered
        replaces its old agent) or whose cache claims more than
        :data:`~kvbridge.runtime.node.MAX_PEER_SLOTS` slots, before anything is built for it."""
        slots = reg.geometry.num_slots + _rows(reg.aux) + _rows(reg.states)
        slots += 0 if reg.window is None else reg.window.num_slots
        if slots > MAX_PEER_SLOTS:
            raise IncompatiblePeerError(
                f"decode {reg.agent} claims a cache of {slots} slots (pages, window pages, "
                f"metadata and state rows), over the {MAX_PEER_SLOTS} kvbridge builds tables for",
                fix="check the decode's KV cache size; a real one is far smaller",
            )
        if self.peers.full_for(reg.agent, reg.seat or None):
            raise IncompatiblePeerError(
                f"this prefill rank already has {self.peers.limit} decode peers",
                fix=(
                    "use fewer decode ranks per prefill server, or set a 'secret' so that only "
                    "your own servers can register"
                ),
            )

    def check_compat(self, reg: wire.Registration) -> None:
        """The decode's compatibility info against this rank's, by hash (as a vLLM
        prefill checks a ``Hello``), before the registration's typed checks.

        Raises:
            IncompatiblePeerError: each property that differs with the decode's value,
                and this prefill's only where the registration was authenticated (a
                ``secret``): the text travels to the decode as its rooms' failure reason.
        """
        if reg.compat is None:
            raise IncompatiblePeerError(
                f"decode {reg.agent} sent no compatibility info (an earlier kvbridge)",
                fix="run the same kvbridge version on the prefill and decode servers",
            )
        if compat_hash(reg.compat) == compat_hash(self.rank.compat):
            return
        raise incompatible(
            {
                field: (ours if self.rank.disclose else UNDISCLOSED, theirs)
                for field, (ours, theirs) in hashed_diff(self.rank.compat, reg.compat).items()
            },
            what=f"decode {reg.agent}'s KV cache is incompatible with this prefill's",
            sides=("prefill", "decode"),
        )

    def pairing(self, reg: wire.Registration) -> Part | None:
        """Check a decode's registration: on the packed path, the heads this rank moves
        to it (:func:`.packed.room_part`; any TP sizes that pair); on the direct path
        None (whole pages: equal TP sizes, or any for MLA, whose every rank holds the
        whole latent cache; SGLang's rank mapping then picks the one prefill rank each
        decode rank reads from and marks the others dummy).

        Raises:
            IncompatiblePeerError: why it cannot be served (its rooms then fail with
                this reason), naming the fix.
        """
        mismatch = settings_mismatch(
            f"decode {reg.agent}",
            {
                "transport": self.rank.transport,
                "wire_dtype": self.rank.wire_dtype,
                "data_path": self.rank.data_path,
            },
            {"transport": reg.transport, "wire_dtype": reg.wire_dtype, "data_path": reg.data_path},
        )
        if mismatch is not None:
            raise mismatch
        self.check_compat(reg)
        page, theirs = self.rank.page_size, reg.page_size or reg.geometry.spec.block_size
        if reg.prefix_cache and theirs % page:
            raise IncompatiblePeerError(
                f"it keeps a radix cache of its own, whose hits end on its pages of {theirs} "
                "tokens, and this prefill's pages "
                f"hold {page}: a room would start inside one of them",
                fix=(
                    "run the decode without --disaggregation-decode-enable-radix-cache, or give it "
                    "a --page-size that is a multiple of the prefill's"
                ),
            )
        check_windows(reg.window, self.rank.window_geometry, packed=self.rank.packed is not None)
        p_tp, d_tp = self.rank.tp_size, reg.tp_size
        check_states(
            reg.states,
            self.rank.state_layout,
            prefill_tp=p_tp,
            decode_tp=d_tp,
            their_split=reg.state_split,
            my_split=self.rank.state_split,
        )
        if self.rank.packed is None:
            if p_tp != d_tp and self.rank.geometry.spec.layout != "latent":
                raise IncompatiblePeerError(
                    f"prefill attention TP {p_tp}, decode TP {d_tp}: the direct data path moves "
                    "whole pages, and an "
                    "SGLang page holds every KV head of its rank token by token",
                    fix=(
                        "set data_path 'packed' (exact values) or wire_dtype 'fp8' in "
                        "KVBRIDGE_CONFIG on both instances"
                    ),
                )
            if reg.geometry.spec != self.rank.geometry.spec:
                raise pages_differ(reg.geometry.spec, self.rank.geometry.spec)
            return None
        mine = self.rank.packed.geometry.spec
        theirs = reg.packed_spec
        if (
            reg.staging is None
            or theirs is None
            or msgspec.structs.replace(theirs, num_kv_heads=mine.num_kv_heads) != mine
        ):
            raise pages_differ(theirs, mine)
        total = self.rank.total_kv_heads
        if reg.kv_heads and reg.kv_heads != total:
            raise IncompatiblePeerError(
                f"its model has {reg.kv_heads} KV heads, this prefill's {total}; serve the same "
                "model on both"
            )
        part = room_part(
            total, p_tp, d_tp, self.rank.tp_rank, reg.tp_rank, latent=mine.layout == "latent"
        )
        if part is None or (mine.num_kv_heads, theirs.num_kv_heads) != (
            heads_per_rank(total, p_tp),
            heads_per_rank(total, d_tp),
        ):
            raise IncompatiblePeerError(
                f"decode rank {reg.tp_rank} of attention TP {d_tp} ({theirs.num_kv_heads} KV "
                f"heads) does not pair with prefill rank {self.rank.tp_rank} of TP {p_tp} "
                f"({mine.num_kv_heads} KV heads) for a model of {total}"
            )
        return part

    def state_cut(self, reg: wire.Registration) -> tuple | None:
        """A decode of another attention TP size with state-space layers: per state
        tensor, the segments of a slot's row this rank writes into the decode rank's
        (:func:`.states.state_cut`, after :meth:`pairing` accepted the split; raises
        :class:`IncompatiblePeerError` as it does). None for an equal size (whole
        rows) or a pool without states."""
        p_tp, d_tp = self.rank.tp_size, reg.tp_size
        if self.rank.state_layout is None or p_tp == d_tp:
            return None
        if self.rank.geometry.spec.layout == "latent":
            kv_sources = latent_sources(p_tp, d_tp, reg.tp_rank)
        else:
            kv_sources = prefill_ranks(self.rank.total_kv_heads, p_tp, d_tp, reg.tp_rank)
        return state_cut(
            self.rank.state_split, p_tp, d_tp, self.rank.tp_rank, reg.tp_rank, kv_sources=kv_sources
        )
