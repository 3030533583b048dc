"""Test-only SGLang plugin: DeepSeek's multi-head latent attention (MLA) on SGLang's
``torch_native`` attention backend, so MLA models run on a CPU without AMX.

Why: SGLang 0.5.23 runs DeepSeek-style models on CPU through its ``intel_amx`` backend,
which needs AMX; this machine has none, so the tests use ``torch_native``. DeepSeek's
attention picks its forward method per backend (``AttentionBackendRegistry`` in
``sglang/srt/models/deepseek_common/attention_backend_handler.py``); ``torch_native`` has
no entry, falls back to the ``triton`` one, and gets the non-absorbed MHA method for
prefills. That method hands the backend queries of ``qk_head_dim`` (nope + rope) while
``torch_native`` attends over the pool's latent buffer, so the first prefill fails with
``Expected size for first two dimensions of batch2 tensor to be: [4, 96] but got:
[4, 576]``. The absorbed MLA method (queries projected into the latent space) is the
one ``torch_native`` computes correctly: with it, the tiny DeepSeek-V2 model
(``kvbridge.demo.model``, shape ``mla``) gives vLLM's greedy tokens.

Fix: register ``torch_native`` -> ``AttnForwardMethod.MLA`` for every forward. Nothing
else changes: the KV pool, its layout and what a disaggregation backend sees are
SGLang's own. Not part of kvbridge; installed into .venv-sglang by
scripts/setup-sglang.sh, loaded in every SGLang process through the entry point
``kvbridge_test_cpu_mla`` (group ``sglang.srt.plugins``).
"""

from __future__ import annotations


def register() -> None:
    """Entry point (group ``sglang.srt.plugins``), run in every SGLang process."""
    from sglang.srt.models.deepseek_common.attention_backend_handler import AttentionBackendRegistry
    from sglang.srt.models.deepseek_common.attention_forward_methods.forward_methods import (
        AttnForwardMethod,
    )

    AttentionBackendRegistry.register(
        "torch_native", lambda attn, forward_batch: AttnForwardMethod.MLA
    )
