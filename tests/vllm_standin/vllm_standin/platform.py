"""The stand-in platform: a CPU ``Platform`` (out of tree) that selects the stand-in worker.

vLLM resolves ``current_platform`` from the entry points of group
``vllm.platform_plugins`` (``vllm/platforms/__init__.py``,
``resolve_current_platform_cls_qualname``): an out-of-tree plugin that activates wins over
the built-in ones, in every vLLM process (API server, engine core, workers). Nothing here
calls vLLM's compiled ops (``vllm._C``), so the CUDA wheel of vLLM runs on a CPU torch.

What it decides for the instance (:meth:`StandInPlatform.check_and_update_config`):

- the worker is :class:`vllm_standin.worker.StandInWorker` (unless ``--worker-cls`` names
  another);
- no torch.compile and no CUDA graphs (there is no model to compile);
- the scheduling vLLM resolved is kept (asynchronous by default, as on a GPU), and Model
  Runner V2 must be what the engine core believes it drives
  (``VllmConfig.use_v2_model_runner``: the scheduler shapes its output for it), which
  :func:`vllm_standin.platform_plugin` asks for with ``VLLM_USE_V2_MODEL_RUNNER=1``;
- the hybrid KV cache manager stays on (``support_hybrid_kv_cache``), as on CUDA.
"""

from __future__ import annotations

import os

import psutil
import torch
from vllm.platforms.interface import Platform, PlatformEnum


class StandInPlatform(Platform):
    _enum = PlatformEnum.OOT
    device_name: str = "cpu"
    device_type: str = "cpu"
    dispatch_key: str = "CPU"
    dist_backend: str = "gloo"
    simple_compile_backend: str = "eager"

    @property
    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.float32, torch.bfloat16, torch.float16]

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        return "kvbridge stand-in (CPU)"

    @classmethod
    def get_device_total_memory(cls, device_id: int = 0) -> int:
        return psutil.virtual_memory().total

    @classmethod
    def set_device(cls, device: torch.device) -> None:
        pass

    @classmethod
    def manual_seed_all(cls, seed: int) -> None:
        pass

    @classmethod
    def inference_mode(cls):
        return torch.no_grad()

    @classmethod
    def is_pin_memory_available(cls) -> bool:
        return False

    @classmethod
    def get_current_memory_usage(cls, device=None) -> float:
        return 0.0

    @classmethod
    def check_if_supports_dtype(cls, dtype: torch.dtype) -> None:
        pass

    @classmethod
    def support_hybrid_kv_cache(cls) -> bool:
        return True

    @classmethod
    def get_punica_wrapper(cls) -> str:
        raise NotImplementedError("the stand-in platform runs no LoRA")

    @classmethod
    def check_and_update_config(cls, vllm_config) -> None:
        from vllm.config import CompilationMode, CUDAGraphMode

        parallel = vllm_config.parallel_config
        if parallel.worker_cls == "auto":
            parallel.worker_cls = "vllm_standin.worker.StandInWorker"
        compilation = vllm_config.compilation_config
        compilation.mode = CompilationMode.NONE
        compilation.cudagraph_mode = CUDAGraphMode.NONE
        compilation.cudagraph_capture_sizes = []
        # 0.34 has no other runner and no such property
        mrv2 = getattr(vllm_config, "use_v2_model_runner", True)
        if vllm_config.model_config is not None and not mrv2:
            raise RuntimeError(
                "the kvbridge stand-in drives the connector in Model Runner V2's order; "
                "vLLM resolved the V1 runner (set VLLM_USE_V2_MODEL_RUNNER=1)"
            )
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")


__all__ = ["StandInPlatform"]
