"""The stand-in model runner: Model Runner V2's request bookkeeping and KV connector call
order around a stand-in forward pass (:mod:`.model`), on CPU tensors.

Mirrors ``vllm/v1/worker/gpu/model_runner.py`` (``GPUModelRunner``, MRV2) of vLLM 0.33
and 0.34, whose connector steps are the same in both (their ``gpu/kv_connector.py`` is
identical); vLLM's own glue does every connector call but the per-layer ones, and vLLM's
own decorator those:

``initialize_kv_cache`` (``GPUModelRunner.initialize_kv_cache``)
  1. the cache: ``vllm.v1.worker.utils.allocate_kv_cache`` (what ``attn_utils.init_kv_cache``
     calls) in the layout the engine core resolved (``VLLM_KV_CACHE_LAYOUT``, else the
     connector's ``get_required_kvcache_layout``): per layer a ``[blocks, heads, block
     size, K|V]`` view over one allocation, as on a GPU; each view bound to its layer;
  2. ``gpu.kv_connector.get_kv_connector(vllm_config, kv_caches)``: ``ActiveKVConnector``
     calls the connector's ``register_kv_caches`` and ``set_host_xfer_buffer_ops``.

``execute_model`` (``GPUModelRunner.execute_model``)
  1. request states: ``finish_requests`` (finished and preempted requests dropped: a
     preempted request comes back among the new ones, with its tokens so far),
     ``add_requests`` (``prefill_token_ids``, ``block_ids``, ``num_computed_tokens``),
     ``update_requests`` (the scheduler's ``num_computed_tokens``, appended block ids,
     ``new_block_ids_to_zero`` zeroed, ``kv_cache_block_copies`` applied with vLLM's
     ``copy_kv_cache_blocks_inplace``);
  2. nothing scheduled: ``kv_connector.no_forward(scheduler_output)`` (pre_forward,
     finish_forward, post_forward: bind metadata, start_load_kv, wait_for_save,
     get_transfer_results, get_block_ids_with_load_errors, stats, clear metadata) and
     return its output;
  3. inside ``set_forward_context(attn_metadata, ..., slot_mapping=...)``:
     ``kv_connector.pre_forward(scheduler_output, input_batch)`` (``handle_preemptions``,
     ``bind_connector_metadata``, ``start_load_kv`` now only if
     ``has_sync_kv_loads``), then the forward: per layer in model order the K|V write of
     the new tokens by slot mapping (``unified_kv_cache_update``, outside the hook), then
     the attention read wrapped in vLLM's ``maybe_transfer_kv_layer``
     (``wait_for_layer_load`` before, ``save_kv_layer(layer, kv_cache, attn_metadata)``
     after, as around ``unified_attention_with_output``);
  4. ``kv_connector.finish_forward()``; the step's state kept for ``sample_tokens``.

``sample_tokens`` (``GPUModelRunner.sample_tokens``)
  1. sample (the per-layer digests summed over TP ranks, :func:`.model.sample`);
  2. ``kv_connector.post_forward(finished_req_ids, defer_finalize=<speculator>)``:
     ``start_load_kv`` for async loads (after the forward), ``wait_for_save`` unless
     deferred, ``get_transfer_results``, ``get_block_ids_with_load_errors``, stats,
     events, worker meta, ``clear_connector_metadata`` unless deferred;
  3. ``postprocess_sampled`` (the sampled token appended, ``num_computed_tokens``
     advanced);
  4. the speculator's ``propose`` would run here; then, if deferred,
     ``kv_connector.finalize_step()`` (``wait_for_save``, ``clear_connector_metadata``).
     The stand-in has no drafter: ``KVBRIDGE_STANDIN_DEFER_FINALIZE=1`` takes the
     deferred path as a speculator would (set by the launcher for MRV2-with-speculator
     runs), with an empty propose step in between.

Fault injection (the tier's test of itself): ``KVBRIDGE_STANDIN_SKIP_BLOCK=<i>`` zeroes
block ``i`` of every layer of each request that arrives with computed tokens (a decode's
loaded prompt, a prefix-cache hit) before its first forward, as if a transfer had skipped
that block; set it on a decode only. Per request: ``"vllm_xargs":
{"kvbridge_standin_skip_block": i}`` in the completion request (vLLM passes it on as
``SamplingParams.extra_args``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from types import SimpleNamespace

import numpy as np
import torch
from vllm.distributed.parallel_state import get_tp_group
from vllm.forward_context import get_forward_context, set_forward_context
from vllm.logger import init_logger
from vllm.model_executor.layers.attention.kv_transfer_utils import maybe_transfer_kv_layer
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.outputs import LogprobsLists, ModelRunnerOutput
from vllm.v1.worker.gpu.kv_connector import NO_OP_KV_CONNECTOR, KVConnector, get_kv_connector
from vllm.v1.worker.utils import allocate_kv_cache, copy_kv_cache_blocks_inplace

from vllm_standin import model as standin

DEFER_ENV = "KVBRIDGE_STANDIN_DEFER_FINALIZE"
log = init_logger("vllm.kvbridge_standin")  # under "vllm": its log handlers print it
_HAS_REQ_ID_TO_INDEX = "req_id_to_index" in {f.name for f in fields(ModelRunnerOutput)}
SKIP_ENV = "KVBRIDGE_STANDIN_SKIP_BLOCK"
SKIP_ARG = "kvbridge_standin_skip_block"
"""The same per request: ``vllm_xargs`` of a completion request (``extra_args``)."""


@dataclass
class RequestState:
    """One request as MRV2's ``RequestState`` row holds it."""

    all_token_ids: list[int]
    prefill_len: int
    num_computed_tokens: int
    block_ids: list[list[int]]
    num_logprobs: int | None = None
    """``SamplingParams.logprobs``: how many top tokens to return with each sample."""


@dataclass
class BatchEntry:
    req_id: str
    start: int
    num_tokens: int
    samples: bool
    digests: list[int] = field(default_factory=list)


class StandInLayer:
    """What an attention layer is to vLLM's forward context: registered under its name in
    ``compilation_config.static_forward_context`` and holding its ``kv_cache`` view."""

    def __init__(self, name: str, index: int) -> None:
        self.layer_name = name
        self.index = index
        self.kv_cache: torch.Tensor | None = None
        self.group = 0


@dataclass
class StandInAttnMetadata:
    """The per-layer attention metadata the connector's ``save_kv_layer`` receives."""

    batch: list[BatchEntry]
    slot_mapping: torch.Tensor


@maybe_transfer_kv_layer
def standin_attention(runner: StandInRunner, layer_name: str) -> None:
    """The attention read of one layer (``unified_attention_with_output``'s place): each
    request that samples this step folds its positions ``0..last`` of this layer into
    its digest, after the connector's ``wait_for_layer_load`` (the decorator)."""
    ctx = get_forward_context()
    meta: StandInAttnMetadata = ctx.attn_metadata[layer_name]
    layer: StandInLayer = ctx.no_compile_layers[layer_name]
    for entry in meta.batch:
        if entry.samples:
            req = runner.requests[entry.req_id]
            entry.digests.append(
                standin.layer_digest(
                    layer.kv_cache,
                    req.block_ids[layer.group],
                    runner.block_size,
                    entry.start + entry.num_tokens,
                    layer.index,
                    runner.heads,
                )
            )


class StandInRunner:
    def __init__(self, vllm_config, device: torch.device) -> None:
        self.vllm_config = vllm_config
        self.device = device
        model_config = vllm_config.model_config
        parallel = vllm_config.parallel_config
        self.num_layers = model_config.get_num_layers(parallel)
        self.num_kv_heads = model_config.get_num_kv_heads(parallel)
        self.head_size = model_config.get_head_size()
        self.block_size = vllm_config.cache_config.block_size
        self.vocab_size = model_config.get_vocab_size()
        self.dtype = model_config.dtype
        tp_rank = get_tp_group().rank_in_group
        self.heads = (
            torch.arange(self.num_kv_heads, dtype=torch.int64) + tp_rank * self.num_kv_heads
        )
        self.layer_names = [f"model.layers.{i}.self_attn.attn" for i in range(self.num_layers)]
        self.layers: dict[str, StandInLayer] = {}
        self.requests: dict[str, RequestState] = {}
        self.kv_caches: dict[str, torch.Tensor] = {}
        self.kv_connector: KVConnector = NO_OP_KV_CONNECTOR
        self.kv_cache_config = None
        self.model = torch.nn.Module()
        self._step: tuple[list[BatchEntry], set[str]] | None = None
        self.defer_finalize = os.environ.get(DEFER_ENV) == "1"
        skip = os.environ.get(SKIP_ENV)
        self.skip_block = int(skip) if skip not in (None, "") else None

    # --- start-up ----------------------------------------------------------------------

    def load_model(self) -> None:
        """Register the stand-in layers in the forward context, as vLLM's ``Attention``
        layers do when the model is built."""
        static = self.vllm_config.compilation_config.static_forward_context
        for i, name in enumerate(self.layer_names):
            self.layers[name] = static[name] = StandInLayer(name, i)

    def get_kv_cache_spec(self) -> dict[str, FullAttentionSpec]:
        return {
            name: FullAttentionSpec(
                block_size=self.block_size,
                num_kv_heads=self.num_kv_heads,
                head_size=self.head_size,
                dtype=self.dtype,
            )
            for name in self.layer_names
        }

    def initialize_kv_cache(self, kv_cache_config) -> None:
        self.kv_cache_config = kv_cache_config
        layout = self.vllm_config.cache_config.get_resolved_kv_cache_layout()
        self.kv_caches = allocate_kv_cache(kv_cache_config, self.device, layout)
        for g, group in enumerate(kv_cache_config.kv_cache_groups):
            for name in group.layer_names:
                self.layers[name].group = g
        for name, layer in self.layers.items():
            layer.kv_cache = self.kv_caches[name]
        self.kv_connector = get_kv_connector(self.vllm_config, self.kv_caches)
        import vllm

        log.info(
            "kvbridge stand-in: vLLM %s, MRV2 connector order (%s finalize), KV cache layout "
            "%s, %d blocks, async scheduling %s, connector %s",
            vllm.__version__,
            "deferred" if self.defer_finalize else "plain",
            layout.name,
            kv_cache_config.num_blocks,
            self.vllm_config.scheduler_config.async_scheduling,
            type(self.kv_connector).__name__,
        )

    def scramble_kv_cache(self) -> None:
        """What sleeping leaves in the cache's memory: not the KV that was there."""
        for cache in self.kv_caches.values():
            cache.fill_(-1)

    # --- one step ------------------------------------------------------------------------

    def _update_states(self, so) -> None:
        """``finish_requests``, ``add_requests``, ``update_requests``."""
        for req_id in so.finished_req_ids | (so.preempted_req_ids or set()):
            self.requests.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            tokens = list(new.prefill_token_ids or new.prompt_token_ids)
            self.requests[new.req_id] = RequestState(
                all_token_ids=tokens,
                prefill_len=len(tokens),
                num_computed_tokens=new.num_computed_tokens,
                block_ids=[list(b) for b in new.block_ids],
                num_logprobs=getattr(new.sampling_params, "logprobs", None),
            )
            extra = getattr(new.sampling_params, "extra_args", None) or {}
            skip = extra.get(SKIP_ARG, self.skip_block)
            if skip is not None and new.num_computed_tokens > 0:
                skip = int(skip)
                self._zero_blocks([ids[skip] for ids in new.block_ids if len(ids) > skip])
        cached = so.scheduled_cached_reqs
        for req_id, computed, new_blocks in zip(
            cached.req_ids, cached.num_computed_tokens, cached.new_block_ids, strict=True
        ):
            req = self.requests[req_id]
            req.num_computed_tokens = computed
            if new_blocks is not None:
                for ids, more in zip(req.block_ids, new_blocks, strict=True):
                    ids.extend(more)
        if getattr(so, "new_block_ids_to_zero", None):
            self._zero_blocks(so.new_block_ids_to_zero)
        if getattr(so, "kv_cache_block_copies", None):
            copy_kv_cache_blocks_inplace(
                list(self.kv_caches.values()),
                self.kv_cache_config.num_blocks,
                so.kv_cache_block_copies,
            )

    def _zero_blocks(self, block_ids: list[int]) -> None:
        index = torch.tensor(block_ids, dtype=torch.int64)
        for cache in self.kv_caches.values():
            cache.index_fill_(0, index, 0)

    def execute_model(self, scheduler_output):
        so = scheduler_output
        self._update_states(so)
        if so.total_num_scheduled_tokens == 0:
            return self.kv_connector.no_forward(so)

        batch: list[BatchEntry] = []
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        for req_id, n in so.num_scheduled_tokens.items():
            req = self.requests[req_id]
            start = req.num_computed_tokens
            end = start + n
            assert end <= len(req.all_token_ids), (req_id, start, n, len(req.all_token_ids))
            ids = req.block_ids[0]
            batch.append(BatchEntry(req_id, start, n, samples=end >= req.prefill_len))
            tokens += req.all_token_ids[start:end]
            positions += range(start, end)
            slots += [
                ids[p // self.block_size] * self.block_size + p % self.block_size
                for p in range(start, end)
            ]
        slot_mapping = torch.tensor(slots, dtype=torch.int64)
        meta = StandInAttnMetadata(batch, slot_mapping)
        attn_metadata = dict.fromkeys(self.layer_names, meta)
        input_batch = SimpleNamespace(
            req_ids=[e.req_id for e in batch],
            idx_mapping=torch.arange(len(batch), dtype=torch.int32),
            num_tokens=len(tokens),
        )
        token_t = torch.tensor(tokens, dtype=torch.int64)
        pos_t = torch.tensor(positions, dtype=torch.int64)
        with set_forward_context(
            attn_metadata,
            self.vllm_config,
            num_tokens=len(tokens),
            slot_mapping=dict.fromkeys(self.layer_names, slot_mapping),
        ):
            self.kv_connector.pre_forward(so, input_batch)
            for name in self.layer_names:
                layer = self.layers[name]
                self._kv_cache_update(layer, token_t, pos_t, slot_mapping)
                standin_attention(self, name)  # positional: the decorator reads args
        self.kv_connector.finish_forward()
        self._step = (batch, so.finished_req_ids)
        return None

    def _kv_cache_update(
        self,
        layer: StandInLayer,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
    ) -> None:
        """``unified_kv_cache_update``: the new tokens' K|V into their slots."""
        cache = layer.kv_cache
        values = standin.kv_values(
            tokens, positions, layer.index, self.heads, cache.shape[-1], cache.dtype
        )
        blocks = torch.div(slots, self.block_size, rounding_mode="floor")
        offsets = slots % self.block_size
        cache[blocks, :, offsets, :] = values

    def _logprobs(self, batch: list[BatchEntry], folded: dict[str, list[int]]):
        """``LogprobsLists`` for the batch (row per request, column 0 the sampled token,
        then the top ``k``), or None when no sampling request asked for logprobs."""
        asked = {
            e.req_id: self.requests[e.req_id].num_logprobs
            for e in batch
            if e.req_id in folded and self.requests[e.req_id].num_logprobs is not None
        }
        if not asked:
            return None
        width = max(*asked.values(), 1) + 1
        ids = np.zeros((len(batch), width), dtype=np.int64)
        lps = np.full((len(batch), width), -9999.0, dtype=np.float32)
        ranks = np.ones(len(batch), dtype=np.int64)
        for row, e in enumerate(batch):
            if e.req_id not in folded:
                continue
            top, values = standin.top_logprobs(folded[e.req_id], self.vocab_size, width - 1)
            ids[row, 0], lps[row, 0] = top[0], values[0]
            ids[row, 1 : len(top) + 1], lps[row, 1 : len(top) + 1] = top, values
        return LogprobsLists(ids, lps, ranks)

    def sample_tokens(self, grammar_output):
        if self._step is None:
            return None
        batch, finished = self._step
        self._step = None
        sampling = [e for e in batch if e.samples]
        if sampling:
            sums = torch.tensor([e.digests for e in sampling], dtype=torch.int64)
            tp = get_tp_group()
            if tp.world_size > 1:
                sums = tp.all_reduce(sums)
            folded = {
                e.req_id: [int(d) % standin.MODULUS for d in row]
                for e, row in zip(sampling, sums.tolist(), strict=True)
            }
        else:
            folded = {}
        sampled = {r: standin.sample(d, self.vocab_size) for r, d in folded.items()}
        output = ModelRunnerOutput(
            req_ids=[e.req_id for e in batch],
            sampled_token_ids=[[sampled[e.req_id]] if e.req_id in sampled else [] for e in batch],
            logprobs=self._logprobs(batch, folded),
            **(
                {"req_id_to_index": {e.req_id: i for i, e in enumerate(batch)}}
                if _HAS_REQ_ID_TO_INDEX  # 0.33; 0.34 dropped the field
                else {}
            ),
        )
        output.kv_connector_output = self.kv_connector.post_forward(
            finished, defer_finalize=self.defer_finalize
        )
        for e in batch:  # postprocess_sampled
            req = self.requests.get(e.req_id)
            if req is None:
                continue
            req.num_computed_tokens = e.start + e.num_tokens
            if e.req_id in sampled:
                req.all_token_ids.append(sampled[e.req_id])
        if self.defer_finalize:
            self.kv_connector.finalize_step()  # after the (stand-in's empty) propose
        return output


__all__ = ["StandInRunner", "standin_attention"]
