"""``KVBridgeConnector``: the class vLLM instantiates, a thin facade.

vLLM creates one instance per process and role: the scheduler-side instance (engine
core) forwards to :class:`~kvbridge.adapters.vllm.scheduler.SchedulerSide`, the
worker-side instance (each worker) to :class:`~kvbridge.adapters.vllm.worker.WorkerSide`.
See ``vllm/distributed/kv_transfer/kv_connector/v1/base.py`` for when each hook runs.

Configuration: ``kv_connector_extra_config`` is kvbridge's config (see README), checked
strictly at start-up; ``kv_role`` picks the side: ``kv_producer`` prefills and sends,
``kv_consumer`` receives and decodes, ``kv_both`` does both.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from kvbridge.adapters.vllm.compat import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
    cache_groups,
    check_version,
    data_parallel_rank,
    is_mla,
    kv_cache_access_registers,
    model_kv_heads,
)
from kvbridge.adapters.vllm.metadata import KVBridgeMetadata
from kvbridge.adapters.vllm.scheduler import SchedulerSide
from kvbridge.adapters.vllm.stats import KVBridgePromMetrics, KVBridgeStats
from kvbridge.adapters.vllm.worker import WorkerSide
from kvbridge.config import load_config
from kvbridge.errors import KVBridgeError

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


def check_parallelism(parallel_config) -> None:
    """Refuse the parallel layouts kvbridge does not map between instances.

    Each decode worker reads from the prefill worker of its own TP rank; pipeline or
    context parallelism would pair workers holding different layers or tokens.
    """
    for name, flag in (
        ("pipeline_parallel_size", "--pipeline-parallel-size"),
        ("prefill_context_parallel_size", "--prefill-context-parallel-size"),
        ("decode_context_parallel_size", "--decode-context-parallel-size"),
    ):
        size = getattr(parallel_config, name, 1)
        if size > 1:
            raise KVBridgeError(
                "kvbridge's vLLM connector supports tensor parallelism only, this instance runs "
                f"{name} {size}",
                fix=f"start the instance with {flag} 1 (tensor parallelism is supported)",
            )


def cache_layout(vllm_config) -> str | None:
    """The GPU cache order kvbridge asks vLLM for (``VLLM_KV_CACHE_LAYOUT`` still
    wins, and vLLM falls back to its backend's choice where that cannot take it):
    heads first (``LBHNC``), so a direct-path transfer between different TP sizes cuts
    a block's heads as byte ranges; tokens first (``LBNHC``) where
    ``transfer_block_size`` cuts blocks into fewer tokens; None for MLA (one latent
    vector per token: the order does not matter)."""
    if vllm_config.model_config is None or is_mla(vllm_config.model_config):
        return None
    ktc = vllm_config.kv_transfer_config
    config = load_config((ktc.kv_connector_extra_config if ktc is not None else None) or {})
    unit = config.transfer_block_size
    return "LBNHC" if unit and unit != vllm_config.cache_config.block_size else "LBHNC"


class KVBridgeConnector(KVConnectorBase_V1, SupportsHMA):
    """kvbridge's vLLM V1 KV connector (layer-wise push and P-first flows).

    ``SupportsHMA``: vLLM keeps its hybrid KV cache manager on, so a model with
    sliding-window layers beside full ones runs with one KV cache group per kind, and a
    sliding layer keeps and moves only its window (the scheduler side's module
    docstring; docs/reference/vllm.md, "Hybrid KV cache manager"), on both data paths. A model
    with state-space layers (Mamba, linear attention) keeps them in groups of their
    own, one state per request, which moves on the direct path, between TP sizes too
    for Mamba2, Gated DeltaNet and short convolutions (the decode computes the last
    prompt token from the prefill's state). Other groups
    are refused at start-up; ``--disable-hybrid-kv-cache-manager`` gives such a
    deployment one group again where the model allows it."""

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config=None) -> bool:
        """No: vLLM (0.32+) asks at start-up and refuses ``--enable-sleep-mode`` with
        "KVBridgeConnector does not support sleep mode". Sleep unmaps the KV cache
        that kvbridge registered with NIXL or Mooncake and whose addresses peers
        hold; supporting it means draining, deregistering and re-registering under a
        new epoch, which kvbridge does not do yet."""
        return False

    @classmethod
    def kv_cache_access(cls, kv_transfer_config=None):
        """vLLM 0.34 asks how the connector reaches the KV cache: kvbridge registers
        its memory with NIXL or Mooncake (:func:`.compat.kv_cache_access_registers`),
        so each segment must be one physical allocation."""
        return kv_cache_access_registers()

    def may_load_async(self, request) -> bool:
        """vLLM 0.34, scheduler side, whenever ``request`` enters the waiting queues
        (with ``--max-num-inflight-kv-loads``): whether it may load its prompt's KV
        asynchronously. True for a decode-side handoff (both flows; vLLM's default
        reads ``do_remote_prefill``, which the push flow's parameters do not carry)."""
        h = self._scheduler.handoff(request) if self._scheduler is not None else None
        return h is not None and h.role == "decode"

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config) -> str | None:
        """vLLM asks once, in the engine core, before allocating the cache."""
        return cache_layout(vllm_config)

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        check_version()
        check_parallelism(vllm_config.parallel_config)
        ktc = vllm_config.kv_transfer_config
        self.config = load_config(ktc.kv_connector_extra_config or {})
        self.engine_id = str(ktc.engine_id)
        kv_role = ktc.kv_role
        send = kv_role in ("kv_producer", "kv_both")
        receive = kv_role in ("kv_consumer", "kv_both")
        block_size = vllm_config.cache_config.block_size
        groups = cache_groups(kv_cache_config, vllm_config)
        if groups:  # the attention groups' (the manager's, which may differ from --block-size)
            block_size = next(g.block_size for g in groups if not g.state)
        self._groups = len(groups)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._idle_step = False
        if role == KVConnectorRole.SCHEDULER:
            windows = [g.window for g in groups]
            states = [i for i, g in enumerate(groups) if g.state]
            self._scheduler = SchedulerSide(
                block_size,
                self.engine_id,
                self.config.host,
                self.config.transfer_block_size,
                windows=windows,
                state_groups=states,
                dp_rank=data_parallel_rank(vllm_config.parallel_config),
            )
            log.info(
                "kvbridge: engine %s is %s, block size %d, %s scheduling",
                self.engine_id,
                kv_role,
                block_size,
                "asynchronous"
                if getattr(vllm_config.scheduler_config, "async_scheduling", False)
                else "synchronous",
            )
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            self._worker = WorkerSide(
                self.config,
                self.engine_id,
                get_tensor_model_parallel_rank(),
                model=str(vllm_config.model_config.model),
                tp_size=vllm_config.parallel_config.tensor_parallel_size,
                total_kv_heads=model_kv_heads(vllm_config.model_config),
                mla=is_mla(vllm_config.model_config),
                block_size=block_size,
                send=send,
                receive=receive,
                groups=groups or None,
            )

    # --- scheduler side ------------------------------------------------------------------

    def on_new_request(self, request) -> None:
        assert self._scheduler is not None
        self._scheduler.on_new_request(request)

    def get_num_new_matched_tokens(
        self, request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_meta(scheduler_output)

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request, (block_ids,))

    def request_finished_all_groups(
        self, request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM calls this instead of :meth:`request_finished` (``SupportsHMA``), with one
        block list per KV cache group."""
        assert self._scheduler is not None
        return self._scheduler.request_finished(request, block_ids)

    def get_loaded_kv_cache_group_ids(self, request) -> tuple[int, ...]:
        """A load writes the request's own blocks in every group (vLLM's default names
        the groups a hash-addressed store holds)."""
        return tuple(range(max(1, self._groups)))

    def update_connector_output(self, connector_output) -> None:
        assert self._scheduler is not None
        self._scheduler.update_output(
            connector_output.finished_sending, connector_output.finished_recving
        )

    def has_pending_push_work(self) -> bool:
        return self._scheduler is not None and self._scheduler.has_pending_work()

    def set_xfer_handshake_metadata(self, metadata) -> None:
        if self._scheduler is not None:
            self._scheduler.set_handshake({(0, rank): m for rank, m in metadata.items()})

    def set_xfer_handshake_metadata_pp_aware(self, metadata) -> None:
        if self._scheduler is not None:
            self._scheduler.set_handshake(metadata)

    # --- worker side ---------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register(kv_caches)

    def get_handshake_metadata(self):
        return None if self._worker is None else self._worker.handshake()

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Before every forward pass: the prefill side must know this step's requests
        before ``save_kv_layer`` runs (``start_load_kv`` may come after the forward)."""
        super().bind_connector_metadata(connector_metadata)
        self._idle_step = (
            isinstance(connector_metadata, KVBridgeMetadata) and connector_metadata.idle
        )
        if self._worker is not None and isinstance(connector_metadata, KVBridgeMetadata):
            self._worker.bind_send(connector_metadata)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVBridgeMetadata)
        self._worker.bind_recv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads are asynchronous and complete before the request is scheduled."""

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        assert self._worker is not None
        self._worker.save_layer(layer_name)

    def wait_for_save(self) -> None:
        assert self._worker is not None
        self._worker.after_forward()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        assert self._worker is not None
        idle, self._idle_step = self._idle_step, False
        sending, recving, failed = self._worker.results(finished_req_ids, idle=idle)
        return KVConnectorTransferResults(
            finished_sending=sending, finished_recving=recving, failed_recving=failed
        )

    def get_kv_connector_stats(self):
        if self._scheduler is not None:  # vLLM adds it to the workers' (requests_shared)
            snap = self._scheduler.stats.take()
            return None if snap.is_empty() else KVBridgeStats(snap.to_dict())
        if self._worker is None:
            return None
        snap = self._worker.stats()
        return None if snap is None else KVBridgeStats(snap.to_dict())

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None):
        return KVBridgeStats(data)

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return KVBridgePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()


__all__ = ["KVBridgeConnector", "check_parallelism"]
