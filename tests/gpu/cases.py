"""Shared by the GPU tests, the emulated kernel tests and the memcheck script: random
paged caches in every layout."""

from __future__ import annotations

import torch

from kvbridge.ops import kv_planes

LAYOUTS = ("fused", "nhd", "hnd")


def make_cache(
    layout: str,
    num_blocks: int,
    block_size: int,
    heads: int,
    dim: int,
    dtype: torch.dtype,
    device: str,
    seed: int,
) -> torch.Tensor:
    """A cache tensor of ``layout`` filled with random values (never zeros: they would
    hide unwritten outputs); a few large rows make the FP8 scales differ a lot."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    if layout == "fused":
        shape = (num_blocks, heads, block_size, 2 * dim)
    elif layout == "nhd":
        shape = (2, num_blocks, block_size, heads, dim)
    elif layout == "latent":
        # MLA: one vector of 2 * dim values per token; its halves are the planes
        assert heads == 1, "a latent cache has one head"
        shape = (num_blocks, block_size, 2 * dim)
    else:
        shape = (2, num_blocks, heads, block_size, dim)
    x = torch.randn(shape, generator=g, dtype=torch.float32)
    x.view(-1, x.shape[-1])[::7] *= 50.0
    if dtype == torch.float8_e4m3fn:
        x = x.clamp(-400, 400)
    return x.to(dtype).to(device)


def planes(cache: torch.Tensor, layout: str):
    return kv_planes(cache, layout, block_size=cache.shape[1] if layout == "latent" else None)


def block_ids(num_blocks: int, count: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randperm(num_blocks, generator=g)[:count]
