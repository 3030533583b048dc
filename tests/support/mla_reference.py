"""An engine-independent reference for FP8 on the wire with MLA models: the model run in
transformers (float32) on a latent cache rounded the way kvbridge's packed format
rounds it (csrc/PACKED_FORMAT.md, "Latent caches"). Shared by the vLLM and SGLang
integration tests (``pythonpath`` in pyproject.toml)."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import torch

FP8_MAX = 448.0  # largest finite float8 e4m3fn


def fp8_halves(x: torch.Tensor) -> torch.Tensor:
    """Each vector's two halves rounded to float8 e4m3 with one float32 scale each:
    ``q = e4m3(x * (448 / amax))``, ``x' = q * (amax / 448)``."""
    rows = x.float().unflatten(-1, (2, x.shape[-1] // 2))
    amax = rows.abs().amax(-1, keepdim=True)
    fmax = torch.full_like(amax, FP8_MAX)
    inv = torch.where(amax > 0, fmax / amax, torch.zeros_like(amax))
    return ((rows * inv).to(torch.float8_e4m3fn).float() * (amax / fmax)).flatten(-2)


@cache
def _model(model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def fp8_latent_logprobs(
    model_dir: Path, cached: list[int], next_token: int, top: int = 5
) -> dict[int, float]:
    """Top ``top`` logprobs after ``next_token``, given the tokens ``cached`` held in a
    latent cache rounded by :func:`fp8_halves`: what a decode instance computes on KV
    that crossed the wire as FP8 (``cached``: what it received; ``next_token``: the first
    token it computes itself)."""
    model = _model(Path(model_dir))
    with torch.no_grad():
        kv = model(torch.tensor([cached]), use_cache=True).past_key_values
        for layer in kv.layers:
            # DeepSeek-V2 caches the normalised latent (keys) and its rope part (values)
            latent = fp8_halves(torch.cat([layer.keys, layer.values], dim=-1))
            layer.keys.copy_(latent[..., : layer.keys.shape[-1]])
            layer.values.copy_(latent[..., layer.keys.shape[-1] :])
        logits = model(torch.tensor([[next_token]]), past_key_values=kv, use_cache=True).logits[
            0, -1
        ]
    values, ids = torch.log_softmax(logits, dim=-1).topk(top)
    return {int(i): float(v) for v, i in zip(values, ids, strict=True)}
