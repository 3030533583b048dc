"""Test-only SGLang plugin: SGLang's ``torch_native`` attention backend reads a
sliding-window layer's KV where its writes put it, so that sliding-window models (in
SGLang's hybrid sliding-window pool) compute correctly on CPU.

Why: SGLang 0.5.23 keeps such a model's window layers in a sub-pool of their own
(``SWAKVPool.swa_kv_pool``), addressed by its own slots: a token's full-pool slot maps
to its window slot through ``translate_loc_from_full_to_swa``. ``torch_native`` writes a
window layer's K and V at the translated slots (``KVWriteLoc(cache_loc,
swa_out_cache_loc)``) but reads them back at the untranslated ones
(``k_cache[req_to_token[...]]`` in ``_run_sdpa_forward_extend`` and ``_decode``), i.e.
from other tokens' slots. A colocated server often gets away with it (its first
requests draw the same slot numbers from both allocators); a disaggregated decode,
whose slots the two allocators hand out differently, does not: measured on the tiny
Laguna model, prompts longer than the window decode other tokens than a colocated
server from the second token on, with SGLang's own Mooncake backend exactly as with
kvbridge's (the same wrong tokens: the KV moved is the same, the reads are wrong).

Fix: the backend sees its pool through a view whose ``get_key_buffer`` and
``get_value_buffer`` of a window layer translate the slots they are indexed with.
Writes, the pool itself and what a disaggregation backend sees are SGLang's own. Not
part of kvbridge; installed into .venv-sglang by scripts/setup-sglang.sh, loaded in
every SGLang process through the entry point ``kvbridge_test_cpu_swa`` (group
``sglang.srt.plugins``).
"""

from __future__ import annotations

BACKEND_INIT = "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend.__init__"


class _WindowSlots:
    """A window layer's K or V buffer indexed by full-pool slots (all the backend does
    with it: ``buffer[slots]``)."""

    def __init__(self, buffer, translate) -> None:
        self._buffer, self._translate = buffer, translate

    def __getitem__(self, slots):
        return self._buffer[self._translate(slots)]


class _ReadsTranslated:
    """The backend's view of an ``SWAKVPool``: reads of window layers translated, all
    else the pool's."""

    def __init__(self, pool) -> None:
        self._pool = pool

    def __getattr__(self, name):
        return getattr(self._pool, name)

    def _read(self, buffer, layer_id: int):
        _, window = self._pool.layers_mapping[layer_id]
        return _WindowSlots(buffer, self._pool.translate_loc_from_full_to_swa) if window else buffer

    def get_key_buffer(self, layer_id: int):
        return self._read(self._pool.get_key_buffer(layer_id), layer_id)

    def get_value_buffer(self, layer_id: int):
        return self._read(self._pool.get_value_buffer(layer_id), layer_id)


def register() -> None:
    """Entry point (group ``sglang.srt.plugins``), run in every SGLang process."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    def around_init(original, backend, *args, **kwargs):
        original(backend, *args, **kwargs)
        if getattr(backend, "use_sliding_window_kv_pool", False):
            backend.token_to_kv_pool = _ReadsTranslated(backend.token_to_kv_pool)

    HookRegistry.register(BACKEND_INIT, around_init, HookType.AROUND)
