"""Test-only SGLang plugin: SGLang's *own* Mooncake and NIXL disaggregation backends,
unmodified except for two CPU fixes, registered as ``mooncake_cpu`` and ``nixl_cpu``.

Why: the benchmark compares kvbridge with SGLang's own backends on a CPU-only machine,
where both stock backends fail before moving a byte (see docs/reference/sglang.md):

- ``mooncake``: the prefill scheduler takes the ``supports_host_tensor_indices`` path,
  which allocates pinned memory and records a CUDA event:
  ``RuntimeError: pin_memory=True requires a CUDA or other accelerator backend``.
  Fix: a sender subclass with ``supports_host_tensor_indices = False``. Mooncake's shared
  transfer engine is created by SGLang only for the backend name ``mooncake``, so the
  manager creates it for ``mooncake_cpu`` the same way.
- ``nixl``: decode registers the KV pool as ``VRAM`` (hard-coded memory kind), which UCX
  without CUDA refuses: ``NIXL_ERR_BACKEND``. Fix: the manager declares ``DRAM``.

Everything else (handshake, bootstrap server, transfer threads, aux data) is SGLang's
code. Not part of kvbridge; installed into .venv-sglang by scripts/setup-sglang.sh.
Use: ``--disaggregation-transfer-backend mooncake_cpu`` (or ``nixl_cpu``) on both sides.
"""

from __future__ import annotations

BACKENDS = ("mooncake_cpu", "nixl_cpu")
_classes: dict = {}


def _build() -> None:
    from sglang.srt.disaggregation.mooncake.conn import (
        MooncakeKVBootstrapServer,
        MooncakeKVManager,
        MooncakeKVReceiver,
        MooncakeKVSender,
    )
    from sglang.srt.disaggregation.nixl.conn import (
        NixlKVBootstrapServer,
        NixlKVManager,
        NixlKVReceiver,
        NixlKVSender,
    )

    class MooncakeCpuKVManager(MooncakeKVManager):
        def __init__(self, args, disaggregation_mode, server_args, is_mla_backend=False, **kw):
            from sglang.srt.distributed.device_communicators import mooncake_transfer_engine as te

            te.init_mooncake_transfer_engine(
                hostname=te.get_local_ip_auto(), gpu_id=args.gpu_id, ib_device=args.ib_device
            )
            super().__init__(args, disaggregation_mode, server_args, is_mla_backend, **kw)

    class MooncakeCpuKVSender(MooncakeKVSender):
        supports_host_tensor_indices = False

    class NixlCpuKVManager(NixlKVManager):
        def __init__(self, args, disaggregation_mode, server_args, is_mla_backend=False, **kw):
            args.kv_data_mem_kinds = ["DRAM"] * len(args.kv_data_ptrs)
            super().__init__(args, disaggregation_mode, server_args, is_mla_backend, **kw)

    _classes["mooncake_cpu"] = (
        MooncakeCpuKVManager,
        MooncakeCpuKVSender,
        MooncakeKVReceiver,
        MooncakeKVBootstrapServer,
    )
    _classes["nixl_cpu"] = (NixlCpuKVManager, NixlKVSender, NixlKVReceiver, NixlKVBootstrapServer)


def _classes_of(name: str):
    if not _classes:
        _build()
    return _classes[name]


def register() -> None:
    """Entry point (group ``sglang.srt.plugins``), run in every SGLang process. Registers
    through kvbridge's own SGLang shims (the same enum member and ``get_kv_class`` hook
    as the ``kvbridge`` backend)."""
    from sglang.srt.disaggregation.utils import TransferBackend

    from kvbridge.adapters.sglang import compat

    for name in BACKENDS:
        if name in TransferBackend._value2member_map_:
            continue
        compat.add_transfer_backend(name)
        compat.hook_get_kv_class(name, lambda name=name: _classes_of(name))
