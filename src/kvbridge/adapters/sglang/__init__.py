"""kvbridge's SGLang integration: ``--disaggregation-transfer-backend kvbridge``.

:func:`register` is kvbridge's ``sglang.srt.plugins`` entry point; SGLang runs it in
every process it starts (launcher, schedulers, detokenizer). It adds the backend name
and routes SGLang's class lookup to :mod:`.manager`. Importing this package imports
nothing from SGLang.

Configuration: the environment variable ``KVBRIDGE_CONFIG``, a JSON object (or ``@path``
to a JSON file) with the keys of :class:`kvbridge.config.KVBridgeConfig`, e.g.
``KVBRIDGE_CONFIG='{"transport": "mooncake"}'``; unset means defaults (NIXL). Set it
identically for the prefill and decode servers.
"""

from kvbridge.adapters.sglang.settings import CONFIG_ENV

BACKEND_NAME = "kvbridge"


def _classes():
    from kvbridge.adapters.sglang.manager import classes

    return classes()


def register() -> None:
    """Register the ``kvbridge`` disaggregation transfer backend (idempotent)."""
    from kvbridge.adapters.sglang import compat

    from sglang.srt.disaggregation.utils import TransferBackend

    if BACKEND_NAME in TransferBackend._value2member_map_:
        return
    compat.add_transfer_backend(BACKEND_NAME)
    compat.hook_get_kv_class(BACKEND_NAME, _classes)


__all__ = ["BACKEND_NAME", "CONFIG_ENV", "register"]
