"""The stand-in worker: vLLM's ``WorkerBase`` on CPU, driving :class:`.runner.StandInRunner`.

Each method vLLM's executor calls mirrors the GPU worker of the installed release
(``vllm/v1/worker/gpu_worker.py``, class ``Worker``) where the KV connector is involved,
and does the least that lets the engine start otherwise:

- ``init_device``: ``init_distributed_environment`` + ``ensure_model_parallel_initialized``
  over gloo (``Worker.init_device`` -> ``init_worker_distributed_environment``);
- ``determine_available_memory``: ``--kv-cache-memory-bytes`` or
  ``KVBRIDGE_STANDIN_KV_BYTES`` (default 64 MiB), no profiling;
- ``initialize_from_config``: ``Worker.initialize_from_config``'s connector order: adopt
  the engine core's layout and hash block size, ``ensure_kv_transfer_initialized``, then
  the runner allocates the cache and builds the MRV2 connector glue (which registers it);
- ``get_kv_connector_handshake_metadata``: vLLM's own ``Worker`` method, unchanged;
- ``sleep`` / ``wake_up`` / ``discard``: ``Worker``'s connector calls
  (``unregister_kv_caches`` before sleep and discard, ``restore_kv_caches`` after a wake
  that restores the cache), with the cache's bytes scrambled while asleep (what a real
  sleep leaves: the memory unmapped or reused).
"""

from __future__ import annotations

import os

import torch
from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
from vllm.distributed.kv_transfer import (
    ensure_kv_transfer_initialized,
    get_kv_transfer_group,
    has_kv_transfer_group,
)
from vllm.v1.worker.gpu_worker import Worker as GPUWorker
from vllm.v1.worker.worker_base import CompilationTimes, WorkerBase

from vllm_standin.runner import StandInRunner

KV_BYTES_ENV = "KVBRIDGE_STANDIN_KV_BYTES"


class StandInWorker(WorkerBase):
    def __init__(
        self,
        vllm_config,
        local_rank: int,
        rank: int,
        distributed_init_method: str,
        is_driver_worker: bool = False,
    ) -> None:
        super().__init__(
            vllm_config=vllm_config,
            local_rank=local_rank,
            rank=rank,
            distributed_init_method=distributed_init_method,
            is_driver_worker=is_driver_worker,
        )
        self.model_runner: StandInRunner | None = None
        self._asleep = False

    # --- start-up (GPU Worker: init_device, load_model, determine_available_memory) ----

    def init_device(self) -> None:
        self.device = torch.device("cpu")
        parallel = self.parallel_config
        init_distributed_environment(
            parallel.world_size,
            self.rank,
            self.distributed_init_method or "env://",
            self.local_rank,
            "gloo",
        )
        ensure_model_parallel_initialized(
            parallel.tensor_model_parallel_size
            if hasattr(parallel, "tensor_model_parallel_size")
            else parallel.tensor_parallel_size,
            parallel.pipeline_parallel_size,
        )
        self.model_runner = StandInRunner(self.vllm_config, self.device)

    def load_model(self, *, load_dummy_weights: bool = False) -> None:
        assert self.model_runner is not None
        self.model_runner.load_model()

    def get_model(self):
        assert self.model_runner is not None
        return self.model_runner.model

    def get_kv_cache_spec(self):
        assert self.model_runner is not None
        return self.model_runner.get_kv_cache_spec()

    def get_supported_kv_cache_layouts(self) -> list[str]:
        """What a worker whose attention backends declare no layout reports (vLLM's
        default preference, ``get_supported_kv_cache_layouts([])``): the engine core then
        resolves the layout from ``VLLM_KV_CACHE_LAYOUT`` or the connector's
        ``get_required_kvcache_layout``, as for a GPU instance."""
        from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts

        return [layout.name for layout in get_supported_kv_cache_layouts([])]

    def determine_available_memory(self) -> int:
        requested = self.cache_config.kv_cache_memory_bytes
        return int(requested or os.environ.get(KV_BYTES_ENV, str(64 << 20)))

    def initialize_from_config(self, kv_cache_config) -> None:
        """``Worker.initialize_from_config`` of vLLM 0.33/0.34, without memory pools."""
        from vllm.v1.attention.backends.utils import record_kv_cache_layout

        self.cache_config.num_gpu_blocks = kv_cache_config.num_blocks
        if kv_cache_config.kv_cache_layout is not None:
            record_kv_cache_layout(self.cache_config, kv_cache_config.kv_cache_layout)
        self.cache_config.hash_block_size = kv_cache_config.hash_block_size
        if hasattr(kv_cache_config, "cache_hit_alignment_tokens"):
            self.cache_config.cache_hit_alignment_tokens = (
                kv_cache_config.cache_hit_alignment_tokens
            )
        ensure_kv_transfer_initialized(self.vllm_config, kv_cache_config)
        assert self.model_runner is not None
        self.model_runner.initialize_kv_cache(kv_cache_config)

    def compile_or_warm_up_model(self) -> CompilationTimes:
        return CompilationTimes(language_model=0.0, encoder=0.0)

    get_kv_connector_handshake_metadata = GPUWorker.get_kv_connector_handshake_metadata

    def get_supported_tasks(self):
        return ("generate",)

    def supports_draft_weight_updates(self) -> bool:
        return False

    def update_max_model_len(self, max_model_len: int) -> None:
        self.model_config.max_model_len = max_model_len

    # --- steps (GPU Worker: execute_model, sample_tokens, take_draft_token_ids) ---------

    @torch.inference_mode()
    def execute_model(self, scheduler_output):
        assert self.model_runner is not None
        return self.model_runner.execute_model(scheduler_output)

    @torch.inference_mode()
    def sample_tokens(self, grammar_output):
        assert self.model_runner is not None
        return self.model_runner.sample_tokens(grammar_output)

    def take_draft_token_ids(self):
        return None

    def execute_dummy_batch(self) -> None:
        pass

    def check_health(self) -> None:
        pass

    def reset_mm_cache(self) -> None:
        pass

    def reset_encoder_cache(self) -> None:
        pass

    # --- sleep mode (GPU Worker: sleep, wake_up, discard) -------------------------------

    def sleep(self, level: int = 1) -> None:
        if has_kv_transfer_group():
            get_kv_transfer_group().unregister_kv_caches()
        assert self.model_runner is not None
        self.model_runner.scramble_kv_cache()
        self._asleep = True

    def wake_up(self, tags: list[str] | None = None) -> None:
        if has_kv_transfer_group() and (tags is None or "kv_cache" in tags):
            get_kv_transfer_group().restore_kv_caches()
        self._asleep = False

    def discard(self, tags: tuple[str, ...]) -> None:
        if has_kv_transfer_group() and "kv_cache" in tags:
            get_kv_transfer_group().unregister_kv_caches()

    def shutdown(self) -> None:
        if has_kv_transfer_group():
            get_kv_transfer_group().shutdown()


__all__ = ["StandInWorker"]
