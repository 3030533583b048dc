"""The stand-in forward's contract (``tests/vllm_standin/vllm_standin/model.py``): the
digest a sampled token comes from changes with any block a request attends to going
missing, stale, misplaced or duplicated."""

from __future__ import annotations

import pytest
import torch
from vllm_standin import model

BLOCK, HEADS, CHANNELS, LAYER = 4, 2, 6, 1


def _cache(tokens: list[int], table: list[int], num_blocks: int = 8) -> torch.Tensor:
    """A ``[blocks, heads, block size, K|V]`` cache holding ``tokens`` through ``table``."""
    cache = torch.zeros(num_blocks, HEADS, BLOCK, CHANNELS)
    heads = torch.arange(HEADS)
    values = model.kv_values(
        torch.tensor(tokens), torch.arange(len(tokens)), LAYER, heads, CHANNELS, cache.dtype
    )
    for p, v in enumerate(values):
        cache[table[p // BLOCK], :, p % BLOCK] = v
    return cache


def _digest(cache: torch.Tensor, table: list[int], count: int) -> int:
    return model.layer_digest(cache, table, BLOCK, count, LAYER, torch.arange(HEADS))


TOKENS = [5, 9, 2047, 13, 7, 7, 100, 3, 42, 8, 11]
TABLE = [3, 6, 1]


def test_the_digest_reads_through_the_block_table() -> None:
    elsewhere = [0, 2, 5]
    assert _digest(_cache(TOKENS, TABLE), TABLE, len(TOKENS)) == _digest(
        _cache(TOKENS, elsewhere), elsewhere, len(TOKENS)
    )


@pytest.mark.parametrize("fault", ["missing", "stale", "misplaced", "duplicated"])
def test_a_wrong_block_changes_the_digest(fault: str) -> None:
    cache = _cache(TOKENS, TABLE)
    good = _digest(cache, TABLE, len(TOKENS))
    if fault == "missing":
        cache[TABLE[1]] = 0
    elif fault == "stale":
        cache[TABLE[1]] = _cache([t + 1 for t in TOKENS], TABLE)[TABLE[1]]
    elif fault == "misplaced":
        cache[[TABLE[0], TABLE[1]]] = cache[[TABLE[1], TABLE[0]]].clone()
    else:
        cache[TABLE[1]] = cache[TABLE[0]]
    assert _digest(cache, TABLE, len(TOKENS)) != good


def test_values_are_exact_and_never_zero() -> None:
    v = model.kv_values(
        torch.tensor([0, 2047]), torch.tensor([0, 4095]), 31, torch.arange(8), 256, torch.float32
    )
    assert (v > 0).all()
    assert torch.equal(v, v.to(torch.int64).to(torch.float32))


def test_sampled_tokens_are_in_the_vocabulary() -> None:
    tokens = {model.sample([d, d * 3 + 1], 2048) for d in range(0, 10**6, 997)}
    assert min(tokens) >= 4 and max(tokens) < 2048 and len(tokens) > 900
