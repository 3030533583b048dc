"""Test-only SGLang plugin: the causal depthwise convolutions of state-space layers
(LFM2's short convolutions) computed in plain torch, so that such models run on a CPU.

Why: SGLang 0.5.23 computes them with Triton kernels
(``sglang.srt.layers.attention.mamba.causal_conv1d``: ``causal_conv1d_fn`` for
prefills, ``causal_conv1d_update`` for decode steps) on every device but CUDA (whose
compiled kernel lives in ``sgl_kernel``), and Triton does not run on this CPU.

Fix: both functions are replaced (``HookType.REPLACE``, which also rebinds the names
models imported) by the few lines of torch below, which follow the docstrings of
SGLang's functions: per request, the convolution's input is the request's conv state
(its last ``width - 1`` inputs, or zeros for a request without a prefix) followed by
its new inputs; the state afterwards holds the last ``width - 1`` of them. The state
pool (``MambaPool``), its layout and what a disaggregation backend sees stay SGLang's
own. Not part of kvbridge; installed into .venv-sglang by scripts/setup-sglang.sh,
loaded in every SGLang process through the entry point ``kvbridge_test_cpu_conv``
(group ``sglang.srt.plugins``).
"""

from __future__ import annotations

import itertools

CONV = "sglang.srt.layers.attention.mamba.causal_conv1d"
PAD_SLOT_ID = -1


def _activate(out, activation):
    import torch.nn.functional as F

    if activation in ("silu", "swish"):
        return F.silu(out)
    if activation is not None:
        raise NotImplementedError(f"activation must be None, silu or swish, not {activation!r}")
    return out


def _convolve(history, x, weight, bias):
    """``history`` (dim, width - 1) then ``x`` (dim, n): the n outputs (dim, n) and the
    new history."""
    import torch
    import torch.nn.functional as F

    width = weight.shape[-1]
    full = torch.cat([history.to(x.dtype), x], dim=-1)
    out = F.conv1d(full.unsqueeze(0), weight.unsqueeze(1), bias, groups=weight.shape[0])[0]
    return out, full[:, full.shape[-1] - (width - 1) :]


def causal_conv1d_fn(
    x,
    weight,
    bias=None,
    query_start_loc=None,
    cache_indices=None,
    has_initial_state=None,
    conv_states=None,
    activation="silu",
    pad_slot_id=PAD_SLOT_ID,
    **kwargs,
):
    """``x`` (dim, total tokens) with ``query_start_loc``, or (batch, dim, seqlen)."""
    import torch

    width = weight.shape[-1]
    if query_start_loc is None:
        sequences = [x[b] for b in range(x.shape[0])]
    else:
        bounds = query_start_loc.tolist()
        sequences = [x[:, s:e] for s, e in itertools.pairwise(bounds)]
    outputs = []
    for b, seq in enumerate(sequences):
        slot = int(cache_indices[b]) if cache_indices is not None else b
        if slot == pad_slot_id:
            outputs.append(torch.zeros_like(seq))
            continue
        initial = has_initial_state is not None and bool(has_initial_state[b])
        history = (
            conv_states[slot]
            if initial and conv_states is not None
            else seq.new_zeros(seq.shape[0], width - 1)
        )
        out, last = _convolve(history, seq, weight, bias)
        if conv_states is not None:
            conv_states[slot].copy_(last)
        outputs.append(_activate(out, activation))
    if query_start_loc is None:
        return torch.stack(outputs)
    return torch.cat(outputs, dim=-1)


def causal_conv1d_update(
    x,
    conv_state,
    weight,
    bias=None,
    activation=None,
    cache_seqlens=None,
    conv_state_indices=None,
    pad_slot_id=PAD_SLOT_ID,
    **kwargs,
):
    """``x`` (batch, dim) or (batch, dim, seqlen); ``conv_state`` (slots, dim, width - 1)."""
    import torch

    if cache_seqlens is not None or kwargs.get("intermediate_conv_window") is not None:
        raise NotImplementedError("circular conv states and speculative tapes are not supported")
    squeeze = x.dim() == 2
    xs = x.unsqueeze(-1) if squeeze else x
    out = torch.zeros_like(xs)
    for b in range(xs.shape[0]):
        slot = int(conv_state_indices[b]) if conv_state_indices is not None else b
        if slot == pad_slot_id:
            continue
        y, last = _convolve(conv_state[slot], xs[b], weight, bias)
        conv_state[slot].copy_(last)
        out[b] = _activate(y, activation)
    return out.squeeze(-1) if squeeze else out


def register() -> None:
    """Entry point (group ``sglang.srt.plugins``), run in every SGLang process."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(f"{CONV}.causal_conv1d_fn", causal_conv1d_fn, HookType.REPLACE)
    HookRegistry.register(f"{CONV}.causal_conv1d_update", causal_conv1d_update, HookType.REPLACE)
