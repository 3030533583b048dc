"""Every SGLang-version shim of the kvbridge backend, in one place.

Supported: SGLang 0.5.23 (tested; ``pip install 'kvbridge[sglang]'`` pins
``sglang>=0.5.23,<0.6``). When the pin moves, re-check what this module touches:

- ``sglang.srt.disaggregation.utils.TransferBackend``: an ``Enum`` with no registration
  API; every scheduler converts ``--disaggregation-transfer-backend`` with
  ``TransferBackend(value)``, so we add a member (:func:`add_transfer_backend`).
- ``sglang.srt.disaggregation.utils.get_kv_class``: raises for unknown backends; wrapped
  with an AROUND hook of ``sglang.srt.plugins.hook_registry.HookRegistry``, which also
  rewrites the ``from ... import get_kv_class`` bindings of already-loaded modules.
- ``sglang.srt.arg_groups.choices.add_disagg_transfer_backend_choices``: argparse choices.
- ``sglang.srt.disaggregation.common.conn``: ``CommonKVManager/Sender/Receiver/
  BootstrapServer`` and the ``ABORT`` / ``ABORT_ACK`` frames, subclassed and reused by
  :mod:`.manager`; ``base.conn.KVPoll``; ``utils.DisaggregationMode``.

Nothing here is imported before SGLang loads the plugin.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

SUPPORTED = ">=0.5.23,<0.6"
TESTED = ("0.5.23",)


def sglang_version() -> str:
    try:
        from importlib.metadata import version

        return version("sglang")
    except Exception:  # noqa: BLE001 - best effort, only for a warning
        return "unknown"


def warn_if_untested() -> None:
    v = sglang_version()
    if v not in TESTED:
        log.warning("kvbridge's SGLang backend is tested with SGLang %s; found %s", ", ".join(TESTED), v)


def add_transfer_backend(name: str) -> None:
    """Make ``--disaggregation-transfer-backend name`` parse and resolve."""
    from sglang.srt.arg_groups.choices import add_disagg_transfer_backend_choices
    from sglang.srt.disaggregation.utils import TransferBackend

    if name in TransferBackend._value2member_map_:
        return
    add_disagg_transfer_backend_choices([name])
    member = object.__new__(TransferBackend)
    member._name_, member._value_ = name.upper(), name
    type.__setattr__(TransferBackend, name.upper(), member)
    TransferBackend._member_map_[name.upper()] = member
    TransferBackend._value2member_map_[name] = member
    TransferBackend._member_names_.append(name.upper())


def hook_get_kv_class(name: str, classes) -> None:
    """Route ``get_kv_class(TransferBackend(name), kind)`` to ``classes()``, a callable
    returning ``(manager, sender, receiver, bootstrap_server)`` classes (imported lazily)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    def around(original, transfer_backend, class_type):
        from sglang.srt.disaggregation.utils import KVClassType

        if getattr(transfer_backend, "value", None) != name or class_type == KVClassType.KVARGS:
            return original(transfer_backend, class_type)
        manager, sender, receiver, bootstrap = classes()
        return {
            KVClassType.MANAGER: manager,
            KVClassType.SENDER: sender,
            KVClassType.RECEIVER: receiver,
            KVClassType.BOOTSTRAP_SERVER: bootstrap,
        }[class_type]

    HookRegistry.register("sglang.srt.disaggregation.utils.get_kv_class", around, HookType.AROUND)


def common():
    """SGLang's shared backend machinery, as a namespace."""
    from types import SimpleNamespace

    from sglang.srt.disaggregation.base.conn import KVArgs, KVPoll
    from sglang.srt.disaggregation.common import conn
    from sglang.srt.disaggregation.utils import DisaggregationMode

    return SimpleNamespace(
        KVArgs=KVArgs,
        KVPoll=KVPoll,
        DisaggregationMode=DisaggregationMode,
        Manager=conn.CommonKVManager,
        Sender=conn.CommonKVSender,
        Receiver=conn.CommonKVReceiver,
        BootstrapServer=conn.CommonKVBootstrapServer,
        AbortNotification=conn.AbortNotification,
        ABORT_TAG=conn.ABORT_TAG,
        ABORT_ACK_TAG=conn.ABORT_ACK_TAG,
        NetworkAddress=conn.NetworkAddress,
    )


__all__ = ["SUPPORTED", "TESTED", "add_transfer_backend", "common", "hook_get_kv_class", "sglang_version", "warn_if_untested"]
