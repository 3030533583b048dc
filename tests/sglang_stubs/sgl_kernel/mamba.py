"""``sgl_kernel.mamba`` of the test-only stand-in (see the package docstring).

SGLang 0.5.23 imports ``causal_conv1d_update_cpu`` from here at module level on CPU
(``layers/attention/linear/kda_backend.py``, loaded for every hybrid model with
state-space layers), and the Gated DeltaNet backend imports the other names. The
short-convolution models the CPU tests run (LFM2) never call them: their convolutions
go through ``sglang.srt.layers.attention.mamba.causal_conv1d``, which the
``sglang_cpu_conv`` plugin computes in torch. Each raises ``NotImplementedError``.
"""

from __future__ import annotations

from sgl_kernel import _unavailable

_LINEAR = "Kimi linear attention (KDA) and Gated DeltaNet layers"

causal_conv1d_update_cpu = _unavailable("mamba.causal_conv1d_update_cpu", _LINEAR)
causal_conv1d_fn_cpu = _unavailable("mamba.causal_conv1d_fn_cpu", _LINEAR)
chunk_gated_delta_rule_cpu = _unavailable("mamba.chunk_gated_delta_rule_cpu", _LINEAR)


def _define_unavailable_ops() -> None:
    """The Gated DeltaNet modules also look up two ``torch.ops.sgl_kernel`` operators at
    import (``gdn_backend.py``, ``kernels/gdn_triton.py``); define them, raising."""
    import torch

    library = torch.library.Library("sgl_kernel", "FRAGMENT")
    for name in ("fused_gdn_gating_cpu", "fused_sigmoid_gating_delta_rule_update_cpu"):
        if hasattr(torch.ops.sgl_kernel, name):
            continue
        library.define(f"{name}(Tensor[] inputs) -> Tensor")
        library.impl(name, _unavailable(name, _LINEAR), "CompositeExplicitAutograd")
    _LIBRARIES.append(library)


_LIBRARIES: list = []  # keeps the operator definitions alive
_define_unavailable_ops()
