"""Worker-side half of the vLLM connector (runs in each worker process).

vLLM calls: ``register_kv_caches`` once after allocating the cache (we build the
:class:`~kvbridge.runtime.endpoint.Endpoint` there); per step ``bind_connector_metadata``
-> the forward pass with ``save_kv_layer`` after every attention layer ->
``start_load_kv`` (vLLM 0.32 starts asynchronous loads after the forward) ->
``wait_for_save`` -> ``get_transfer_results``; ``shutdown`` at exit. So the prefill
side binds its steps in ``bind_connector_metadata``, never in ``start_load_kv``.

The forward pass is never blocked: ``save_kv_layer`` only records that a layer is
done (O(requests in the batch)); the sender thread does the transfers. On a GPU the
host reaches ``save_kv_layer`` when it has queued the layer's kernels, not when they
have run: there each call records one CUDA event on the current stream (the one
computing the layer), and the sender posts nothing of the layer before the event has
completed; ``wait_for_save`` does the same for the end of the forward, and binding a
request whose prompt starts with prefix-cache hits for those blocks (vLLM schedules a
step while the previous one may still run on the GPU). Completions are
reported to vLLM exactly once: a prefill request in ``finished_sending`` only after the
scheduler finished it (vLLM's contract) and the sender released its blocks; a decode
request in ``finished_recving`` (and ``failed_recving`` when its load failed).

Block ids: the scheduler side hands the worker *transfer blocks* (config
``transfer_block_size``, default vLLM's block size); :meth:`WorkerSide.register`
addresses the cache in the same units, so the runtime never sees vLLM's own. With
vLLM's hybrid manager (KV cache groups, a sliding window among them) they come as
:class:`~kvbridge.core.blocks.BlockTable` s, and the worker tells the runtime which
group each layer takes its blocks from (``CompatInfo.layer_groups``: peers must agree).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from kvbridge.adapters.vllm.cache import geometry_from_tensors, layer_order
from kvbridge.adapters.vllm.compat import CacheGroup, extract_layer_index
from kvbridge.adapters.vllm.metadata import KVBridgeHandshake, KVBridgeMetadata, SendStep
from kvbridge.config import KVBridgeConfig
from kvbridge.core.lifecycle import RecvPhase, SendPhase
from kvbridge.errors import ConfigError, KVBridgeError, PlanError
from kvbridge.runtime.device import record_device_event
from kvbridge.runtime.endpoint import Endpoint
from kvbridge.runtime.stats import LIMIT_GAUGES, REQUEST_GAUGES, StatsSnapshot
from kvbridge.wire.peer_compat import CompatInfo

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.005
"""Longest wait for a transfer outcome in a step that computes nothing (see
:meth:`WorkerSide.results`)."""


class WorkerSide:
    def __init__(
        self,
        config: KVBridgeConfig,
        engine_id: str,
        rank: int,
        model: str,
        tp_size: int,
        block_size: int,
        send: bool,
        receive: bool,
        total_kv_heads: int = 0,
        mla: bool = False,
        groups: list[CacheGroup] | None = None,
    ) -> None:
        self.config = config
        self.engine_id = engine_id
        self.rank = rank
        self.model = model
        self.tp_size = tp_size
        self.total_kv_heads = total_kv_heads
        """The model's KV heads before the TP split (0: this rank's heads x TP size)."""
        self.mla = mla
        """The model's attention is MLA: its cache holds one latent vector per token."""
        self.groups = groups
        """vLLM's KV cache groups when kvbridge tells them apart (several, or one that is
        a sliding window: :func:`~kvbridge.adapters.vllm.compat.cache_groups`), else None."""
        self.block_size = block_size
        self.send = send
        self.receive = receive
        self.endpoint: Endpoint | None = None
        self._layer_index: dict[str, int] = {}
        self._steps: list[SendStep] = []
        self._send_req: dict[str, str] = {}  # transfer id -> req id, prefill side
        self._recv_req: dict[str, str] = {}  # transfer id -> req id, decode side
        self._aborted_recv: set[str] = set()  # decode req ids the scheduler finished early
        # prefill req ids released, not yet finished by the scheduler
        self._released: set[str] = set()
        self._finished: set[str] = set()  # prefill req ids the scheduler finished, not yet released
        # prefill req ids whose transfer id was taken: never tracked
        self._refused_send: set[str] = set()
        self._refused_recv: set[str] = set()  # decode req ids whose transfer id was taken: failed
        # levels of the last snapshot returned (:meth:`stats`)
        self._reported_levels: dict[str, int] = {}
        self._on_device = False  # the cache is GPU memory: readiness behind compute events

    # --- start-up --------------------------------------------------------------------------

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        ordered = layer_order(list(kv_caches), extract_layer_index)
        self._layer_index = {name: i for i, name in enumerate(ordered)}
        state_layers = {name for g in self.groups or () if g.state for name in g.layer_names}
        if state_layers and self.config.packed:
            raise ConfigError(
                "data_path packed (and wire_dtype fp8) moves attention KV through staging; this "
                "model has state-space layers, "
                "whose states kvbridge moves on the direct path only",
                key="wire_dtype" if self.config.wire_dtype == "fp8" else "data_path",
                fix=(
                    "leave data_path and wire_dtype at their defaults (direct, exact) for this "
                    "model"
                ),
            )
        geometry = geometry_from_tensors(
            kv_caches, ordered, self.block_size, mla=self.mla, state_layers=state_layers
        )
        unit = self.config.transfer_block_size or self.block_size
        if unit != self.block_size:  # vLLM's blocks addressed as several smaller ones
            try:
                geometry = geometry.in_blocks_of(unit)
            except PlanError as exc:
                raise ConfigError(
                    f"transfer_block_size {unit}: {exc}",
                    key="transfer_block_size",
                    fix="leave it 0 and give prefill and decode the same --block-size",
                ) from exc
        if not self.total_kv_heads:
            self.total_kv_heads = geometry.spec.num_kv_heads * self.tp_size
        layer_groups, windows = self._layer_groups(ordered)
        states = tuple(g.state for g in self.groups) if state_layers else ()
        compat = CompatInfo.from_spec(
            geometry.spec,
            model=self.model,
            tp_size=self.tp_size,
            wire_dtype=self.config.wire_dtype,
            total_kv_heads=self.total_kv_heads,
            data_path=self.config.resolved_data_path,
            layer_groups=layer_groups,
            group_windows=windows,
            group_states=states,
        )
        planes = None
        if self.config.packed:  # the packed path reads and writes the tensors
            from kvbridge.ops import kv_planes

            planes = [
                kv_planes(kv_caches[name], geometry.spec.layout, self.block_size)
                for name in ordered
            ]
            if unit != self.block_size:  # token-major blocks (in_blocks_of checked): views
                planes = [tuple(p.view(-1, unit, *p.shape[2:]) for p in pair) for pair in planes]
        self.endpoint = Endpoint(
            self.config,
            geometry,
            compat,
            self.engine_id,
            self.rank,
            send=self.send,
            receive=self.receive,
            planes=planes,
        )
        self._on_device = geometry.memory == "device"
        log.info(
            "kvbridge: worker %d ready (%s, %d layers, %d blocks, %s, wire %s, %s), "
            "side channel %s",
            self.rank,
            self.config.transport,
            geometry.spec.num_layers,
            geometry.num_blocks,
            geometry.spec.layout,
            self.config.wire_dtype,
            self.config.resolved_data_path,
            self.endpoint.address,
        )

    def _layer_groups(self, ordered: list[str]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Per layer (model order) its KV cache group, and per group its sliding window;
        both empty when groups are not told apart.

        Raises:
            ConfigError: a layer in no group.
        """
        if not self.groups:
            return (), ()
        of = {name: g for g, group in enumerate(self.groups) for name in group.layer_names}
        missing = [name for name in ordered if name not in of]
        if missing:
            raise ConfigError(
                f"KV cache layers {missing} are in none of vLLM's KV cache groups",
                fix="report this model to kvbridge",
            )
        return tuple(of[name] for name in ordered), tuple(g.window for g in self.groups)

    def handshake(self) -> KVBridgeHandshake | None:
        if self.endpoint is None:
            return None
        return KVBridgeHandshake(
            address=self.endpoint.address, epoch=self.endpoint.epoch, engine_id=self.engine_id
        )

    # --- per step --------------------------------------------------------------------------

    def bind_send(self, meta: KVBridgeMetadata) -> None:
        """Prefill side of this step's metadata; called before the forward pass (vLLM
        binds metadata before it, but may start loads only after it)."""
        ep = self.endpoint
        if ep is None or ep.sender is None:
            return
        for req_id, tid in meta.abort_send.items():
            self._send_req.setdefault(tid, req_id)
            ep.sender.abort(tid, "the prefill request was aborted")
        for req_id, tid in meta.drop_send.items():  # vLLM holds nothing for it: never reported
            self._send_req.pop(tid, None)
            self._released.discard(req_id)
            ep.sender.abort(tid, "vLLM preempted the prefill request and freed its blocks")
        for tid, why in meta.never_sent.items():  # nothing held, never reported
            ep.sender.never_sent(tid, why)
        self._steps = []
        for step in meta.send:
            if step.req_id in self._refused_send:
                continue
            if step.first and step.transfer_id in self._send_req:
                # the scheduler side lets one request send a transfer id at a time; if it
                # ever did not, fail the newcomer here rather than inside vLLM's step
                log.error(
                    "kvbridge: request %s names transfer %s, which request %s sends from this "
                    "worker; it is not sent",
                    step.req_id,
                    step.transfer_id,
                    self._send_req[step.transfer_id],
                )
                self._refused_send.add(step.req_id)
                # nothing held for it: reported once the scheduler finishes it
                self._released.add(step.req_id)
                continue
            self._steps.append(step)
            if step.first:
                self._send_req[step.transfer_id] = step.req_id
                # a prefix hit may be blocks an earlier forward, still queued on the GPU, writes
                ready = record_device_event() if self._on_device and step.computed_before else None
                ep.sender.track(
                    step.transfer_id,
                    step.new_blocks,
                    step.num_tokens,
                    step.computed_before,
                    pull=step.flow == "pull",
                    ready=ready,
                    ticket=step.ticket,
                )
            elif step.new_blocks:
                ep.sender.add_blocks(step.transfer_id, step.new_blocks)

    def bind_recv(self, meta: KVBridgeMetadata) -> None:
        """Decode side of this step's metadata: start the asynchronous loads."""
        ep = self.endpoint
        if ep is None or ep.receiver is None:
            return
        for task in meta.recv:
            if task.transfer_id in self._recv_req:  # see bind_send: one request per transfer id
                log.error(
                    "kvbridge: request %s names transfer %s, which request %s loads on this "
                    "worker; its load fails",
                    task.req_id,
                    task.transfer_id,
                    self._recv_req[task.transfer_id],
                )
                self._refused_recv.add(task.req_id)
                continue
            self._recv_req[task.transfer_id] = task.req_id
            try:  # the prefill workers holding this worker's KV heads, and idle ones to release
                sources = task.prefill.sources(self.rank, self.tp_size, self.total_kv_heads)
                idle = task.prefill.idle(self.rank, self.tp_size, self.total_kv_heads)
            except KVBridgeError as exc:
                ep.receiver.refuse(task.transfer_id, task.block_ids, task.num_tokens, str(exc))
                continue
            addresses = [s.address for s in sources]
            if task.flow == "pull":
                epochs = [s.epoch or None for s in sources]
                remote = task.remote_blocks if task.remote_blocks is not None else []
                ep.receiver.expect_pull(
                    task.transfer_id,
                    addresses,
                    epochs,
                    remote,
                    task.block_ids,
                    task.num_tokens,
                    task.skip_tokens,
                    ticket=task.ticket,
                )
            else:
                ep.receiver.expect_push(
                    task.transfer_id,
                    addresses,
                    task.block_ids,
                    task.num_tokens,
                    task.skip_tokens,
                    ticket=task.ticket,
                )
            if idle:
                ep.receiver.release_idle(
                    task.transfer_id,
                    [s.address for s in idle],
                    [s.epoch or None for s in idle],
                    ticket=task.ticket,
                )
        for forgo in meta.forgo:
            try:
                sources = forgo.prefill.sources(self.rank, self.tp_size, self.total_kv_heads)
                sources += forgo.prefill.idle(self.rank, self.tp_size, self.total_kv_heads)
            except KVBridgeError:
                continue  # a prefill this worker cannot pair with: its lease frees the blocks
            ep.receiver.forgo(
                forgo.transfer_id,
                [s.address for s in sources],
                [s.epoch or None for s in sources],
                forgo.reason,
                ticket=forgo.ticket,
            )
        for req_id, tid in meta.abort_recv.items():
            if ep.receiver.abort(tid, "the engine finished the request before its KV arrived"):
                self._aborted_recv.add(req_id)  # reported in finished_sending once the load stops
            # else: its load was already reported in finished_recving, which makes vLLM
            # free the blocks of a finished request itself: report nothing more

    def save_layer(self, layer_name: str) -> None:
        """An attention layer finished this step's tokens. Hot path."""
        if not self._steps or self.endpoint is None or self.endpoint.sender is None:
            return
        layer = self._layer_index.get(layer_name)
        if layer is None:
            return
        sender = self.endpoint.sender
        ready = record_device_event() if self._on_device else None
        for step in self._steps:
            sender.layer_done(step.transfer_id, layer, step.computed_after, ready)

    def after_forward(self) -> None:
        """The step's forward pass is over (queued, on a GPU): every layer holds its tokens."""
        if self.endpoint is None or self.endpoint.sender is None:
            return
        last = [step for step in self._steps if step.last]
        ready = record_device_event() if self._on_device and last else None
        for step in last:
            self.endpoint.sender.prefill_done(step.transfer_id, ready)
        self._steps = []

    def results(
        self, finished_req_ids: set[str], idle: bool = False
    ) -> tuple[set[str], set[str], set[str]]:
        """(finished_sending, finished_recving, failed_recving) for this step.

        ``idle``: the step computes nothing; vLLM steps only to poll transfers and would
        spin (engine core and worker busy-looping) until they finish. If transfers are
        pending and no outcome is ready, wait up to :data:`IDLE_WAIT_S` for one: an
        outcome ends the wait at once, a new request waits at most that long.
        """
        sending: set[str] = set()
        recving: set[str] = set()
        failed: set[str] = set()
        ep = self.endpoint
        if ep is None:
            return sending, recving, failed
        if idle and (self._send_req or self._recv_req):
            ep.activity.wait(IDLE_WAIT_S)
        ep.activity.clear()  # outcomes from here on are taken now or wake the next wait
        if ep.sender is not None:
            # the release may come before or after the scheduler finishes the request
            known = set(self._send_req.values()) | self._released
            self._finished |= finished_req_ids & known
            self._refused_send -= finished_req_ids
            for tid in ep.sender.take_released():
                req_id = self._send_req.pop(tid, None)
                if req_id is not None:
                    self._released.add(req_id)
            ready = self._released & self._finished
            self._released -= ready
            self._finished -= ready
            sending |= ready
        if ep.receiver is not None:
            recving |= self._refused_recv
            failed |= self._refused_recv
            self._refused_recv = set()
            done, bad = ep.receiver.take_finished()
            for tid in done + bad:
                req_id = self._recv_req.pop(tid, None)
                if req_id is None:
                    continue
                if req_id in self._aborted_recv:  # the scheduler holds its blocks: free them now
                    self._aborted_recv.discard(req_id)
                    sending.add(req_id)
                elif tid in bad:
                    recving.add(req_id)  # failed loads are reported as finished, too
                    failed.add(req_id)
                else:
                    recving.add(req_id)
        return sending, recving, failed

    def stats(self) -> StatsSnapshot | None:
        """This step's statistics (vLLM's ``get_kv_connector_stats``, once per step), or
        None. A snapshot returned carries the current levels (:meth:`_levels`), and one
        is returned whenever something was recorded, a level of requests in flight
        (:data:`~kvbridge.runtime.stats.REQUEST_GAUGES`) or of staging held is not zero,
        or a level changed since the last one: a rank that returns None holds nothing, so
        vLLM's sum (staging slots) or maximum (requests) over the ranks that report is the
        instance's level."""
        if self.endpoint is None:
            return None
        snap = self.endpoint.stats.take()
        levels = self._levels()
        held = any(
            value
            for name, value in levels.items()
            if name in REQUEST_GAUGES or name == "staging_slots_used"
        )
        if snap.is_empty() and not held and levels == self._reported_levels:
            return None
        self._reported_levels = levels
        for name, value in levels.items():
            setattr(snap, name, value)
        return snap

    def _levels(self) -> dict[str, int]:
        """Requests in flight per phase (:data:`~kvbridge.runtime.stats.REQUEST_GAUGES`),
        the bounded per-peer structures (:data:`~kvbridge.runtime.stats.LIMIT_GAUGES`)
        and, on the packed path, the staging slots (of the instance: every rank has as
        many) and those this rank's requests hold."""
        ep = self.endpoint
        assert ep is not None
        levels = dict.fromkeys((*REQUEST_GAUGES, *LIMIT_GAUGES), 0)
        levels.update(
            peers=ep.node.num_peers,
            replay_entries=len(ep.node.note_replays)
            + (0 if ep.server is None else len(ep.server.replays)),
        )
        if ep.sender is not None:
            sends = ep.sender.phases()
            levels.update(
                sends_held=sends[SendPhase.HELD],
                sends_sending=sends[SendPhase.SENDING],
                sends_early=ep.sender.early,
                sends_early_block_ids=ep.sender.early_block_ids,
            )
        if ep.receiver is not None:
            recvs = ep.receiver.phases()
            levels.update(
                receives_allocated=recvs[RecvPhase.ALLOCATED],
                receives_waiting=recvs[RecvPhase.WAITING],
                receives_receiving=recvs[RecvPhase.RECEIVING],
            )
        packed = ep.node.packed
        if packed is not None:
            levels.update(
                staging_slots=packed.allocator.num_slots * self.tp_size,
                staging_slots_used=packed.allocator.num_slots - packed.allocator.free_slots,
            )
        return levels

    def close(self) -> None:
        if self.endpoint is not None:
            self.endpoint.close()
            self.endpoint = None


__all__ = ["WorkerSide"]
