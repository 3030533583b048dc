"""The stand-in forward pass: what the stand-in writes into the KV cache, and the token it
samples from what it reads back. Pure torch, no vLLM.

Contract (what makes the tier catch transfer bugs):

- :func:`kv_values` is the K|V content of one token at one position in one layer, every
  KV head and channel: a function of (token id, position, layer, global head index,
  channel) only, never 0 (so an unwritten or zeroed block reads differently) and an exact
  integer in float32 (so it survives any copy bit for bit).
- :func:`layer_digest` reads a request's positions ``0..last`` of one layer back through
  its block table and folds every value with a weight of its own (position, head,
  channel): a missing, misplaced, stale or duplicated block changes the digest (up to
  collisions of a 61-bit sum).
- :func:`sample` turns the digests of all layers into a token id in ``[first, vocab)``,
  the same on every TP rank once the ranks' digests are summed (each rank holds its own
  heads, as a real model's attention does before the all-reduce).
"""

from __future__ import annotations

import torch

MODULUS = (1 << 61) - 1
"""Digests are summed modulo this prime."""

_VALUE_MOD = 65521
"""K|V values are in ``[1, _VALUE_MOD]``: exact in float32, bfloat16 excepted."""


def kv_values(
    tokens: torch.Tensor,
    positions: torch.Tensor,
    layer: int,
    heads: torch.Tensor,
    channels: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The cache content of ``tokens`` at ``positions`` (both ``[n]`` int64) in ``layer``
    for the global head indices ``heads`` (``[H]``): ``[n, H, channels]`` of ``dtype``."""
    t = tokens.view(-1, 1, 1)
    p = positions.view(-1, 1, 1)
    h = heads.view(1, -1, 1)
    c = torch.arange(channels, dtype=torch.int64).view(1, 1, -1)
    raw = t * 7919 + p * 104729 + layer * 1299709 + h * 15485863 + c * 32452843
    return ((raw % _VALUE_MOD) + 1).to(dtype)


def weights(layer: int, positions: int, heads: torch.Tensor, channels: int) -> torch.Tensor:
    """The weight of each value of ``layer`` at positions ``0..positions-1`` (``[positions,
    H, channels]`` int64 in ``[1, 2**16]``), a fixed function of (layer, position, global
    head, channel)."""
    p = torch.arange(positions, dtype=torch.int64).view(-1, 1, 1)
    h = heads.view(1, -1, 1)
    c = torch.arange(channels, dtype=torch.int64).view(1, 1, -1)
    mixed = (p * 2654435761 + h * 40503 + c * 9973 + layer * 1000003) % 2147483647
    return (mixed * 48271 % 2147483647) % 65536 + 1


def gather_positions(
    cache: torch.Tensor, block_ids: list[int], block_size: int, count: int
) -> torch.Tensor:
    """Positions ``0..count-1`` of a request from one layer's cache view ``[num_blocks, H,
    block_size, C]`` (vLLM's ``[B, H, N, C]`` view, any physical order) through its block
    table: ``[count, H, C]``."""
    need = -(-count // block_size)
    index = torch.tensor(block_ids[:need], dtype=torch.int64)
    blocks = cache.index_select(0, index)  # [need, H, N, C]
    return blocks.permute(0, 2, 1, 3).reshape(need * block_size, *blocks.shape[1:2], -1)[:count]


def layer_digest(
    cache: torch.Tensor,
    block_ids: list[int],
    block_size: int,
    count: int,
    layer: int,
    heads: torch.Tensor,
) -> int:
    """The digest of one layer of a request whose positions ``0..count-1`` are in the
    cache (:func:`gather_positions`)."""
    values = gather_positions(cache, block_ids, block_size, count).to(torch.int64)
    w = weights(layer, count, heads, values.shape[-1])
    return int((values * w).sum().item()) % MODULUS


def _fold(digests: list[int]) -> int:
    acc = 0
    for layer, d in enumerate(digests):
        acc = (acc * 1000003 + d * (layer + 1)) % MODULUS
    return acc


def sample(digests: list[int], vocab_size: int, first: int = 4) -> int:
    """The token sampled from the per-layer digests (summed over TP ranks)."""
    return first + _fold(digests) % (vocab_size - first)


def top_logprobs(
    digests: list[int], vocab_size: int, k: int, first: int = 4
) -> tuple[list[int], list[float]]:
    """The ``k`` most likely tokens and their log-probabilities, most likely first: the
    sampled token (:func:`sample`), then ``k - 1`` others, all a function of the
    digests (a stand-in has no logits; these only have to move with the KV).

    >>> ids, lps = top_logprobs([1, 2], 2048, 3)
    >>> ids[0] == sample([1, 2], 2048), len(set(ids)), lps == sorted(lps, reverse=True)
    (True, 3, True)
    """
    acc = _fold(digests)
    span = vocab_size - first
    ids = [first + acc % span]
    step = 1
    while len(ids) < min(k, span):
        candidate = first + (acc + step * 40503) % span
        if candidate not in ids:
            ids.append(candidate)
        step += 1
    margin = 0.25 + (acc % 1000) / 1000.0
    return ids, [-margin * (i + 1) for i in range(len(ids))]


__all__ = [
    "MODULUS",
    "gather_positions",
    "kv_values",
    "layer_digest",
    "sample",
    "top_logprobs",
    "weights",
]
