"""Scheduler-side half of the vLLM connector (runs in the engine-core process).

vLLM calls, per request: ``get_num_new_matched_tokens`` (maybe repeatedly),
``update_state_after_alloc`` after blocks are allocated, ``request_finished`` exactly
once; per step: ``build_connector_meta``, then ``update_connector_output`` with what
the workers reported. This class keeps the per-request bookkeeping and turns it into
:class:`~kvbridge.adapters.vllm.metadata.KVBridgeMetadata` for the workers; it does no
I/O.

Ownership: on the prefill side, a handed-off request's blocks stay with kvbridge after
it finishes (``request_finished`` returns True) until a worker reports them in
``finished_sending``; on the decode side, a request aborted while its KV is still
arriving is held the same way, so no write lands in a block vLLM reallocated.

One transfer per transfer id and instance: vLLM fans a request with ``n > 1`` out into
sibling requests that carry the same ``kv_transfer_params``, submitted one by one. On
the decode side the first sibling loads the prompt's KV; the others wait for that load
to end (``matched_tokens`` answers None, vLLM asks again next step) or arrive after it
ended, and take what arrived from the prefix cache and compute the rest. On the
prefill side a request naming a transfer id in use or used is computed as a plain
request. Used ids are remembered for the last
:data:`~kvbridge.core.lifecycle.ENDED_MEMORY` transfers.

A decode request that vLLM computes itself after all (it asked for prompt logprobs:
``update_state_after_alloc`` then reports no external tokens) tells its prefill to let
go of the transfer (:class:`~kvbridge.adapters.vllm.metadata.Forgo`).

KV cache groups (vLLM's hybrid manager, a model with sliding-window layers): vLLM hands
every block list as one list per group, position by position in lockstep; with several
groups, or one that is a sliding window, each list this class hands on is a
:class:`~kvbridge.core.blocks.BlockTable` of one row per group, vLLM's null block (a
sliding group's positions before its window) as :data:`~kvbridge.core.blocks.NONE`. The
decode side allocates only a sliding group's window (vLLM pads the rest with the null
block), and the prefill's writes leave out what it does not hold, so a sliding layer
moves its window only.

The last prompt token of a model with sliding-window or state-space layers is computed
by the decode (:attr:`SchedulerSide.backoff`): the prefill computes all but that token
(:meth:`SchedulerSide.on_new_request` drops it as vLLM adds the request, and stops the
request after one output token), the decode loads that much and computes the last
token itself, as vLLM's own NIXL connector does for state-space models.

- State-space layers (Mamba, linear attention; vLLM keeps one state per request in a
  group of their own, ``mamba_cache_mode`` ``none``): a state holds every token it has
  seen, so a decode cannot recompute the last prompt token on top of the prefill's
  state as it recomputes an attention layer's. In a block table such a group's row
  holds the request's state block at its last position and nothing elsewhere: it
  moves when the whole prompt has been computed.
- Sliding windows: a decode that loaded a whole prompt of ``N`` tokens would recompute
  its last token (vLLM's way to sample after a full hit), whose window reaches back to
  token ``N - W``; where ``N - W + 1`` is a multiple of the block size, vLLM's padding of
  a load of ``N`` tokens nulls that token's block (measured: first-token logprobs off by
  7e-3 to 95 there, 2e-6 to 6e-6 elsewhere), and a prefill that computed ``N`` tokens
  frees it when it finishes. Loading ``N - 1`` tokens computed by the prefill keeps it on
  both sides, at every length.

A prompt no longer than the backoff (one token) is not handed off: the decode computes
it, the prefill computes it as a plain request.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvbridge.adapters.vllm import params as kvparams
from kvbridge.adapters.vllm.compat import (
    FINISHED_LENGTH,
    FINISHED_OK,
    NULL_BLOCK_ID,
    block_updates,
    drop_prompt_tail,
    state_block,
)
from kvbridge.adapters.vllm.metadata import (
    Forgo,
    KVBridgeHandshake,
    KVBridgeMetadata,
    RecvTask,
    SendStep,
)
from kvbridge.core.blocks import NONE, BlockTable
from kvbridge.core.layout import sub_block_ids
from kvbridge.core.lifecycle import EndedTransfers
from kvbridge.errors import ConfigError, PlanError
from kvbridge.runtime.stats import TransferStats

log = logging.getLogger(__name__)

_NONE = kvparams.Handoff(role="prefill", flow="push", transfer_id="")  # cached "no handoff"


@dataclass
class _Prefill:
    transfer_id: str
    flow: str
    num_tokens: int
    ticket: str = ""
    started: bool = False
    blocks: int = 0
    """Blocks (of ``transfer_block_size`` tokens) handed to the workers so far."""
    state: dict[int, int] = field(default_factory=dict)
    """Per state-space group, the block holding the request's state."""


class SchedulerSide:
    """Args:
    block_size: vLLM's block size.
    transfer_block_size: tokens per block as kvbridge addresses them (config key of
        that name; 0: ``block_size``). Every block id this class hands to the
        workers or to the peer (``kv_transfer_params``) is in those units: vLLM's
        block ``b`` is blocks ``b * m`` to ``b * m + m - 1``,
        ``m = block_size / transfer_block_size``, cut to the blocks the prompt fills.
    windows: per KV cache group (vLLM's hybrid manager, module docstring) its
        sliding window in tokens, 0 for full attention; empty: one group that
        keeps every block (no tables).
    state_groups: the indices of the state-space groups among them.
    dp_rank: this engine's data-parallel rank, published in its address
        (:class:`~.params.PrefillAddress`).
    """

    def __init__(
        self,
        block_size: int,
        engine_id: str,
        host: str,
        transfer_block_size: int = 0,
        windows: Sequence[int] = (),
        state_groups: Iterable[int] = (),
        dp_rank: int = 0,
    ) -> None:
        self.block_size = block_size
        self.dp_rank = dp_rank
        self.unit = transfer_block_size or block_size
        if block_size % self.unit:
            raise ConfigError(
                f"transfer_block_size {self.unit} does not divide vLLM's block size {block_size}",
                key="transfer_block_size",
                fix=(
                    "use a divisor of both instances' --block-size, the same on prefill and decode "
                    "(0: the engine's own)"
                ),
            )
        self._ratio = block_size // self.unit
        self._grouped = bool(windows)
        """Block lists are tables, vLLM's null block as NONE (every group told apart)."""
        self._windows = sorted({w for w in windows if w})
        self._states = sorted(set(state_groups))
        self.backoff = 1 if self._states or self._windows else 0
        """Prompt tokens at the end that the prefill leaves to the decode (module docstring)."""
        self.engine_id = engine_id
        self.host = host
        self._handoffs: dict[str, kvparams.Handoff] = {}
        self._recv_new: list[RecvTask] = []
        self._forgo_new: list[Forgo] = []
        self._recv_active: dict[str, str] = {}  # req_id -> transfer_id, KV still arriving
        # transfer_id -> req_id loading it (inverse of _recv_active)
        self._recv_owner: dict[str, str] = {}
        self._sharing: dict[str, str] = {}  # req_id -> transfer_id another request is loading
        self._send_owner: dict[str, str] = {}  # transfer_id -> prefill req_id sending it
        self._send_tid: dict[str, str] = {}  # its inverse
        self._recv_ended = EndedTransfers()  # transfer ids loaded (or given up) here
        self._send_ended = EndedTransfers()  # transfer ids sent (or given up) here
        self._recv_done: set[str] = set()  # received once: a preempted request recomputes
        self._prefill: dict[str, _Prefill] = {}
        self._held: set[str] = set()
        self._abort_send: dict[str, str] = {}
        self._abort_recv: dict[str, str] = {}
        self._never_sent: dict[str, str] = {}
        self._workers: dict[int, KVBridgeHandshake] = {}
        # P-first prefill requests too short to hand off (module docstring)
        self._not_handed: set[str] = set()
        self.stats = TransferStats()
        """What this side counts (``requests_shared``); the connector reports it with
        the workers' statistics."""

    # --- handshake metadata from the workers ----------------------------------------------

    def set_handshake(self, metadata: dict[tuple[int, int], Any]) -> None:
        for (pp_rank, tp_rank), meta in metadata.items():
            if isinstance(meta, KVBridgeHandshake) and pp_rank == 0:
                self._workers[tp_rank] = meta

    def _address(self) -> kvparams.PrefillAddress | None:
        """Where decode workers reach ours: every TP rank's side channel, or None
        before every worker reported one."""
        workers = [self._workers.get(rank) for rank in range(len(self._workers))]
        if not workers or any(w is None or w.address is None for w in workers):
            return None
        ranks = [kvparams.RankAddress(address=w.address, epoch=w.epoch) for w in workers]
        first = workers[0]
        return kvparams.PrefillAddress(
            address=first.address,
            engine_id=first.engine_id,
            epoch=first.epoch,
            ranks=ranks,
            dp_rank=self.dp_rank,
        )

    # --- per request -----------------------------------------------------------------------

    def handoff(self, request) -> kvparams.Handoff | None:
        h = self._handoffs.get(request.request_id)
        if h is None:
            h = kvparams.parse(request.kv_transfer_params, request.request_id) or _NONE
            self._handoffs[request.request_id] = h
        return None if h is _NONE else h

    def on_new_request(self, request) -> None:
        """vLLM added ``request``. A prefill handing off a model with sliding-window or
        state-space layers computes all but the last :attr:`backoff` prompt tokens
        (module docstring); a prompt no longer than that is not handed off, nor is a
        request whose first token goes to the client (``first_token``)."""
        h = self.handoff(request)
        if not self.backoff or h is None or h.role != "prefill" or h.flow == "discover":
            return
        req_id = request.request_id
        if h.first_token:
            # its token goes to the client as the first (kvbridge proxy --first-token):
            # sampled from the whole prompt, so there is nothing left for a decode to load
            # and compute the last token of; the decode computes the prompt itself
            log.info(
                "kvbridge: request %s: its first token is the client's, so it is computed "
                "whole and not handed off (this model's decode computes its last prompt "
                "token itself)",
                req_id,
            )
        elif request.num_prompt_tokens <= self.backoff:
            log.info(
                "kvbridge: request %s (%d tokens) is computed without a handoff: its decode "
                "computes it too",
                req_id,
                request.num_prompt_tokens,
            )
        elif drop_prompt_tail(request, self.backoff):
            return
        else:
            log.warning(
                "kvbridge: request %s has neither prompt token ids nor embeddings; it is computed "
                "without a handoff",
                req_id,
            )
        self._handoffs[req_id] = _NONE
        if h.flow == "pull":  # the router still expects parameters for the decode
            self._not_handed.add(req_id)

    def _to_load(self, request) -> int:
        """Decode side: the prompt tokens whose KV the prefill sends (all but the last
        :attr:`backoff`; none when the prompt is no longer than that), at most those its
        blocks hold (P-first: a decode prompt that extends the prefill's, e.g. by the
        prefill's first token, computes the rest itself)."""
        n = request.num_prompt_tokens
        n = n - self.backoff if n > self.backoff else 0
        h = self.handoff(request)
        if h is not None and h.remote_tokens is not None:
            n = min(n, h.remote_tokens)
        return n

    def matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Decode side: the prompt tokens this instance lacks, loaded asynchronously.
        None (vLLM asks again next step): another request is loading the same transfer."""
        h = self.handoff(request)
        req_id = request.request_id
        if (
            h is None
            or h.role != "decode"
            or req_id in self._recv_active
            or req_id in self._recv_done
        ):
            return 0, False
        if req_id in self._sharing:
            if self._sharing[req_id] in self._recv_owner:
                return None, False
            del self._sharing[req_id]  # the load ended: its blocks are in the prefix cache
            self._recv_done.add(req_id)
            return 0, False
        owner = self._recv_owner.get(h.transfer_id)
        if owner is not None:
            log.info(
                "kvbridge: request %s shares transfer %s with %s (n > 1?): it waits for that load, "
                "then reads its prefix cache",
                req_id,
                h.transfer_id,
                owner,
            )
            self._sharing[req_id] = h.transfer_id
            self.stats.add(requests_shared=1)
            return None, False
        if h.transfer_id in self._recv_ended:
            log.info(
                "kvbridge: request %s names transfer %s, which ended here (n > 1?): it reads its "
                "prefix cache",
                req_id,
                h.transfer_id,
            )
            self._recv_done.add(req_id)
            self.stats.add(requests_shared=1)
            return 0, False
        count = self._to_load(request) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        h = self.handoff(request)
        if h is None:
            return
        if h.role == "prefill":
            if h.flow == "discover":
                return
            if request.request_id not in self._prefill:
                if h.transfer_id in self._send_owner or h.transfer_id in self._send_ended:
                    log.warning(
                        "kvbridge: request %s names transfer %s, which another request sends or "
                        "sent (n > 1 on a prefill?); computing it without a handoff",
                        request.request_id,
                        h.transfer_id,
                    )
                    self._handoffs[request.request_id] = _NONE
                    return
                self._send_owner[h.transfer_id] = request.request_id
                self._send_tid[request.request_id] = h.transfer_id
                self._prefill[request.request_id] = _Prefill(
                    h.transfer_id, h.flow, request.num_prompt_tokens, ticket=h.ticket
                )
            return
        if request.request_id in self._recv_active:
            return
        assert h.prefill is not None
        if num_external_tokens <= 0:
            # vLLM computes the prompt itself (it does for prompt logprobs) after all
            if self._let_go(request.request_id, h, "the decode computes the prompt itself"):
                self._recv_done.add(request.request_id)
            return
        num_tokens = self._to_load(request)
        if not self._grouped:
            all_ids = blocks.get_block_ids()[0]
            new_ids = blocks.get_unhashed_block_ids()
            skip_blocks = len(all_ids) - len(new_ids)  # prefix-cache hits come first
        else:
            # local hits (whole blocks) come first in every group; a sliding one pads with
            # the null block
            skip_blocks = (num_tokens - num_external_tokens) // self.block_size
            new_ids = [ids[skip_blocks:] for ids in blocks.get_block_ids()]
        needed = math.ceil(num_tokens / self.block_size) - skip_blocks
        filled = math.ceil(num_tokens / self.unit) - skip_blocks * self._ratio
        if not self._grouped:
            block_ids = self._ids(new_ids[:needed], filled)
        else:
            total = math.ceil(num_tokens / self.unit)
            state = self._state_blocks(blocks.get_block_ids())
            block_ids = self._table(
                [ids[:needed] for ids in new_ids],
                filled,
                first=total - filled,
                total=total,
                state=state,
            )
        self._recv_new.append(
            RecvTask(
                req_id=request.request_id,
                transfer_id=h.transfer_id,
                flow=h.flow,
                prefill=h.prefill,
                block_ids=block_ids,
                num_tokens=num_tokens,
                skip_tokens=skip_blocks * self.block_size,
                remote_blocks=h.remote_blocks if not self._grouped else h.remote_table(),
                ticket=h.ticket,
            )
        )
        self._recv_active[request.request_id] = h.transfer_id
        self._recv_owner[h.transfer_id] = request.request_id

    def build_meta(self, scheduler_output) -> KVBridgeMetadata:
        meta = KVBridgeMetadata(
            recv=self._recv_new,
            forgo=self._forgo_new,
            abort_send=self._abort_send,
            abort_recv=self._abort_recv,
            never_sent=self._never_sent,
            idle=scheduler_output.total_num_scheduled_tokens == 0,
        )
        self._recv_new, self._forgo_new, self._abort_send, self._abort_recv = [], [], {}, {}
        self._never_sent = {}
        if self._prefill:
            computed = {
                r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs
            }
            cached = scheduler_output.scheduled_cached_reqs
            computed.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
            preempted = scheduler_output.preempted_req_ids or set()
            for req_id, new_blocks, whole_table in block_updates(scheduler_output):
                p = self._prefill.get(req_id)
                if p is None:
                    continue
                if whole_table and p.started:  # resumed after a preemption
                    self._preempted(meta, req_id)
                    continue
                before = computed[req_id]
                if before >= p.num_tokens:
                    continue  # decoding (max_tokens > 1): nothing more to send
                after = min(before + scheduler_output.num_scheduled_tokens[req_id], p.num_tokens)
                try:
                    if not p.started and self._states:
                        p.state = self._state_blocks(new_blocks)
                    total = math.ceil(p.num_tokens / self.unit)
                    new = (
                        self._blocks(
                            new_blocks, total - p.blocks, first=p.blocks, total=total, state=p.state
                        )
                        if new_blocks
                        else []
                    )
                except PlanError as exc:
                    # vLLM's groups out of step: give the transfer up, not the engine
                    log.error(
                        "kvbridge: request %s: %s; its transfer %s is given up",
                        req_id,
                        exc,
                        p.transfer_id,
                    )
                    self._preempted(meta, req_id)
                    continue
                p.blocks += len(new)
                meta.send.append(
                    SendStep(
                        req_id=req_id,
                        transfer_id=p.transfer_id,
                        flow=p.flow,
                        num_tokens=p.num_tokens,
                        new_blocks=new,
                        computed_before=before,
                        computed_after=after,
                        first=not p.started,
                        ticket=p.ticket,
                    )
                )
                p.started = True
            for req_id in preempted & set(self._prefill):
                if self._prefill[req_id].started:
                    self._preempted(meta, req_id)
        return meta

    def _preempted(self, meta: KVBridgeMetadata, req_id: str) -> None:
        """vLLM preempted a prefill whose transfer has started and freed its blocks (it
        holds nothing for it any more): the transfer is given up (the decode side's load
        fails and its failure policy applies), and the request, once resumed, is
        computed as a plain one. The workers abort the transfer without reporting it in
        ``finished_sending``; its transfer id stays taken until the request finishes."""
        p = self._prefill.pop(req_id)
        meta.drop_send[req_id] = p.transfer_id
        self._handoffs[req_id] = _NONE

    def _let_go(self, req_id: str, h: kvparams.Handoff, reason: str) -> bool:
        """Decode side: ``req_id`` will not load its transfer; tell its prefill's workers
        to let go of it (:class:`Forgo`, sent by the workers at the next step). False,
        and nothing sent, when the transfer is another request's (a sibling that loads
        it, n > 1) or already ended here (loaded, or let go of)."""
        tid = h.transfer_id
        if req_id in self._recv_done or tid in self._recv_owner or tid in self._recv_ended:
            return False
        assert h.prefill is not None
        log.info("kvbridge: request %s lets go of transfer %s: %s", req_id, tid, reason)
        self._forgo_new.append(Forgo(req_id, tid, h.prefill, ticket=h.ticket, reason=reason))
        self._recv_ended.add(tid, "forgone")
        return True

    def request_finished(
        self, request, block_ids: Sequence[list[int]]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Called once per request before vLLM frees its blocks (``block_ids``: one list
        per KV cache group). True: kvbridge holds them until a worker reports
        ``finished_sending``."""
        req_id = request.request_id
        self._recv_done.discard(req_id)
        self._sharing.pop(req_id, None)
        h = self._handoffs.pop(req_id, None)
        if h is None and request.kv_transfer_params:
            h = self.handoff(request)  # ended before the scheduler first saw it
            self._handoffs.pop(req_id, None)
        if req_id in self._not_handed:
            self._not_handed.discard(req_id)
            return False, kvparams.local_response()
        if h is None or h is _NONE:
            self._free_transfer_id(req_id)  # preempted after its transfer had started
            return False, None
        if h.role == "decode":
            transfer_id = self._recv_active.get(req_id)
            if transfer_id is None:
                # Never loaded: ended before admission (vLLM 0.33+ submits a request its
                # API server rejected as an ``abort_immediately`` marker, so that this
                # hook runs), or before its load began. The prefill still holds its
                # blocks: let go of them now, not at the end of its lease.
                self._let_go(req_id, h, "the decode request ended before its KV was loaded")
                return False, None
            # aborted while its KV is still arriving: hold the blocks until the prefill side stops
            self._abort_recv[req_id] = transfer_id
            self._held.add(req_id)
            return True, None
        if h.flow == "discover":
            address = self._address()
            return False, (None if address is None else kvparams.discover_response(address))
        p = self._prefill.pop(req_id, None)
        if p is None or not p.started:
            self._free_transfer_id(req_id)
            if h.flow == "push" and self._send_owner.get(h.transfer_id) is None:
                # its decode may wait for it already: tell it now (not another request's)
                self._never_sent[h.transfer_id] = (
                    "the prefill request ended before it was computed "
                    f"({getattr(request.status, 'name', request.status)})"
                )
            return False, None  # never computed, nothing was sent or held
        self._held.add(req_id)
        if request.status not in FINISHED_OK or (
            h.first_token and request.status != FINISHED_LENGTH
        ):
            # ended early, or its first token ended it (no decode continues from it):
            # the workers give the transfer up and report the blocks free
            self._abort_send[req_id] = p.transfer_id
            return True, None
        if p.flow == "pull":
            address = self._address()
            if address is None:
                log.warning(
                    "kvbridge: no side-channel address known yet; request %s cannot be pulled",
                    req_id,
                )
                self._abort_send[req_id] = p.transfer_id
                return True, None
            port = int(address.address.rsplit(":", 1)[1])
            total = math.ceil(p.num_tokens / self.unit)
            blocks = self._blocks(block_ids, total, total=total, state=p.state)
            return True, kvparams.pull_response(
                p.transfer_id,
                address,
                self.engine_id,
                blocks,
                p.num_tokens,
                self.host,
                port,
                ticket=p.ticket,
            )
        # push: tell the caller where we are (a proxy notices a restarted prefill here)
        address = self._address()
        return True, (None if address is None else kvparams.discover_response(address))

    def _ids(self, block_ids, limit: int) -> list[int]:
        """vLLM's ``block_ids`` in transfer blocks, at most ``limit`` of them."""
        if self._ratio == 1:
            return list(block_ids)[: max(0, limit)]
        return sub_block_ids(block_ids, self._ratio, limit)

    def _table(
        self,
        per_group: Sequence[Sequence[int]],
        limit: int,
        *,
        first: int = 0,
        total: int = 0,
        state: Mapping[int, int] | None = None,
    ) -> BlockTable:
        """One block list per KV cache group (vLLM's, the same positions; from the
        request's position ``first`` on) as a table in transfer blocks, vLLM's null block
        as NONE, at most ``limit`` positions. A state-space group's row holds
        ``state[group]`` at the request's last position (``total - 1``) when that is
        among them, NONE elsewhere.

        Raises:
            PlanError: the attention groups' lists differ in length.
        """
        rows = [
            None
            if g in self._states
            else self._ids([NONE if b == NULL_BLOCK_ID else b for b in ids], limit)
            for g, ids in enumerate(per_group)
        ]
        n = len(next(r for r in rows if r is not None))
        for g in self._states:
            rows[g] = [NONE] * n
            if 0 <= total - 1 - first < n:
                rows[g][total - 1 - first] = state[g]
        return BlockTable.grouped(rows)

    def _state_blocks(self, per_group: Sequence[Sequence[int]]) -> dict[int, int]:
        """Per state-space group, the block holding the request's state (vLLM's lists).

        Raises:
            PlanError: vLLM gave a state-space group no block.
        """
        if not per_group or any(not per_group[g] for g in self._states):
            raise PlanError("vLLM allocated no state block for the request's state-space layers")
        return {g: state_block(per_group[g]) for g in self._states}

    def _blocks(
        self,
        per_group: Sequence[Sequence[int]],
        limit: int,
        *,
        first: int = 0,
        total: int = 0,
        state: Mapping[int, int] | None = None,
    ) -> list[int] | BlockTable:
        """vLLM's block lists, one per KV cache group, as the workers take them: the one
        group's list, or a table of every group's (:meth:`_table`)."""
        return (
            self._ids(per_group[0], limit)
            if not self._grouped
            else self._table(per_group, limit, first=first, total=total, state=state)
        )

    def update_output(
        self, finished_sending: set[str] | None, finished_recving: set[str] | None
    ) -> None:
        for req_id in finished_sending or ():
            self._held.discard(req_id)
            self._free_transfer_id(req_id)
            self._end_recv(req_id)  # a decode request aborted while loading
        for req_id in finished_recving or ():
            if self._end_recv(req_id):
                self._recv_done.add(req_id)

    def _free_transfer_id(self, req_id: str) -> None:
        transfer_id = self._send_tid.pop(req_id, None)
        if transfer_id is not None:
            del self._send_owner[transfer_id]
            self._send_ended.add(transfer_id)

    def _end_recv(self, req_id: str) -> bool:
        transfer_id = self._recv_active.pop(req_id, None)
        if transfer_id is None:
            return False
        if self._recv_owner.get(transfer_id) == req_id:
            del self._recv_owner[transfer_id]
            self._recv_ended.add(transfer_id)
        return True

    def has_pending_work(self) -> bool:
        """Keep the engine stepping while kvbridge holds blocks it must hand back."""
        return bool(self._held)


__all__ = ["SchedulerSide"]
