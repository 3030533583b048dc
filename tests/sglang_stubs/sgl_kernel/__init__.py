"""Test-only stand-in for ``sgl_kernel`` (SGLang's native kernel library) on a CPU machine.

Not part of kvbridge: it lives under tests/ and ``scripts/setup-sglang.sh`` puts this
directory on ``.venv-sglang``'s ``sys.path``. See ``tests/sglang_stubs/README.md``.

SGLang 0.5.23 has no CPU wheel of ``sgl_kernel`` on the registry, yet with ``--device
cpu`` it imports the names below at module level (``if _is_cpu: from sgl_kernel import
...``). On a CPU without AMX none of them runs for a plain (non-speculative) model: they
serve speculative decoding (EAGLE trees, draft cache locations) and in-pool KV copies.
Each one raises ``NotImplementedError`` naming itself, so a path that does reach one fails
loudly instead of computing something wrong.

Deliberately absent: ``sgl_kernel.scalar_type`` and ``sgl_kernel.allreduce``. SGLang
imports both inside ``try/except ImportError`` and falls back (mock quantization scalar
types; no custom all-reduce), which is the right behaviour on CPU.
"""

from __future__ import annotations

__version__ = "0.0.0+kvbridge.test.stub"


def _unavailable(name: str, used_by: str):
    def kernel(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} is not available: this is kvbridge's test-only sgl_kernel "
            f"stand-in (tests/sglang_stubs), and SGLang calls this CPU kernel only for "
            f"{used_by}, which the CPU test set-up does not support"
        )

    kernel.__name__ = kernel.__qualname__ = name
    return kernel


_SPECULATIVE = "speculative decoding"

# sglang/srt/mem_cache/allocation.py (speculative-decode allocation)
assign_req_to_token_pool_cpu = _unavailable("assign_req_to_token_pool_cpu", _SPECULATIVE)
# sglang/kernels/ops/kvcache/cache_move.py (KV copies inside the pool: speculative/HiSparse)
copy_all_layer_kv_cache_cpu = _unavailable(
    "copy_all_layer_kv_cache_cpu",
    "KV-cache copies inside the pool (speculative decoding, HiSparse)",
)
# sglang/kernels/ops/speculative/cache_locs.py
assign_draft_cache_locs_contiguous_cpu = _unavailable(
    "assign_draft_cache_locs_contiguous_cpu", _SPECULATIVE
)
assign_extend_cache_locs_cpu = _unavailable("assign_extend_cache_locs_cpu", _SPECULATIVE)
# sglang/kernels/ops/speculative/spec_tree.py
build_tree_kernel_efficient_cpu = _unavailable("build_tree_kernel_efficient_cpu", _SPECULATIVE)
verify_tree_greedy_cpu = _unavailable("verify_tree_greedy_cpu", _SPECULATIVE)
# sglang/kernels/ops/speculative/eagle.py
fill_accept_out_cache_loc_cpu = _unavailable("fill_accept_out_cache_loc_cpu", _SPECULATIVE)
fill_bonus_tokens_cpu = _unavailable("fill_bonus_tokens_cpu", _SPECULATIVE)

__all__ = [
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
    "assign_req_to_token_pool_cpu",
    "build_tree_kernel_efficient_cpu",
    "copy_all_layer_kv_cache_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
    "verify_tree_greedy_cpu",
]
