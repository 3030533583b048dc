"""kvbridge's SGLang integration: ``--disaggregation-transfer-backend kvbridge``.

:func:`register` is kvbridge's ``sglang.srt.plugins`` entry point; SGLang runs it in
every process it starts (launcher, schedulers, detokenizer). It adds the backend name,
routes SGLang's class lookup to :mod:`.manager`, and wraps the forward pass for
per-layer streaming (:func:`.compat.hook_layerwise`; inert unless a kvbridge prefill
manager lives in the process). Importing this package imports nothing from SGLang.

Configuration: the environment variable ``KVBRIDGE_CONFIG``, a JSON object (or ``@path``
to a JSON file) with the keys of :class:`kvbridge.config.KVBridgeConfig`, e.g.
``KVBRIDGE_CONFIG='{"transport": "mooncake"}'``; unset means defaults (NIXL). Set it
identically for the prefill and decode servers.
"""

import sys

from kvbridge.adapters.sglang.settings import CONFIG_ENV

BACKEND_NAME = "kvbridge"


def _classes():
    from kvbridge.adapters.sglang.manager import classes

    return classes()


def _plan_forward(batch, model_runner):
    # The backend's modules are imported only where SGLang resolved it.
    prefill = sys.modules.get("kvbridge.adapters.sglang.prefill")
    return None if prefill is None else prefill.plan_forward(batch, model_runner)


def register() -> None:
    """Register the ``kvbridge`` disaggregation transfer backend (idempotent)."""
    from sglang.srt.disaggregation.utils import TransferBackend

    from kvbridge.adapters.sglang import compat

    if BACKEND_NAME in TransferBackend._value2member_map_:
        return
    compat.add_transfer_backend(BACKEND_NAME)
    compat.hook_get_kv_class(BACKEND_NAME, _classes)
    compat.hook_layerwise(_plan_forward)


__all__ = ["BACKEND_NAME", "CONFIG_ENV", "register"]
