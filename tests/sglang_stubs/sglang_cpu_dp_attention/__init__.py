"""Test-only SGLang plugin: data-parallel attention (``--attn-dp-size``) on SGLang's
``torch_native`` attention backend, so a DP-attention server runs on a CPU without AMX.

Why: with DP attention every attention-DP rank joins each forward (the MLP stays tensor
parallel), and SGLang 0.5.23 pads the ranks' batches to one size first
(``ForwardBatch.prepare_mlp_sync_batch`` -> ``_pad_inputs_to_size``). On CPU it asks the
attention backend for the sequence length of the padding rows through
``get_cpu_graph_seq_len_fill_value``, which only the ``intel_amx`` backend (AMX CPUs)
defines: on ``torch_native`` the first forward of a rank with fewer requests fails with
``AttributeError: 'TorchNativeAttnBackend' object has no attribute
'get_cpu_graph_seq_len_fill_value'``.

Fix: ``torch_native`` answers 1, as ``intel_amx`` does (a padding row is one token
long; its output is dropped). Nothing else changes: the pools, their layout and what a
disaggregation backend sees are SGLang's own. Measured: a colocated tiny DeepSeek-V2
(MLA) server with ``--tp 2 --attn-dp-size 2`` then gives the greedy tokens of a TP 1
server, token for token. (A Llama model under DP attention still fails on CPU, with a
collective mismatch between an idle and a busy rank; SGLang's DP attention is made for
DeepSeek-style models, which the tests use.)

Not part of kvbridge; installed into .venv-sglang by scripts/setup-sglang.sh, loaded in
every SGLang process through the entry point ``kvbridge_test_cpu_dp_attention`` (group
``sglang.srt.plugins``).
"""

from __future__ import annotations


def register() -> None:
    """Entry point (group ``sglang.srt.plugins``), run in every SGLang process."""
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    if not hasattr(TorchNativeAttnBackend, "get_cpu_graph_seq_len_fill_value"):
        TorchNativeAttnBackend.get_cpu_graph_seq_len_fill_value = _one_token


def _one_token(self) -> int:
    return 1
