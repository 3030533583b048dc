"""Pure-torch pack / unpack: the specification the CUDA kernels are tested against.

Runs on any device torch supports (CPU when there is no GPU, and on CUDA tensors when
the kernels cannot be built). Inputs are already validated by :mod:`kvbridge.ops`:

- ``layers``: per layer its K and V planes as ``(num_blocks, block_size, num_heads,
  head_dim)`` views with any strides (see :func:`kvbridge.ops.kv_planes`), all layers
  of the same shape and dtype;
- ``block_ids``: int64 tensor on the planes' device; token ``t`` lives in block
  ``block_ids[t // block_size]`` at offset ``t % block_size``;
- ``out`` / ``packed``: a uint8 tensor of ``len(layers) * fmt.nbytes`` bytes or more:
  one region per layer, back to back, each laid out as :mod:`kvbridge.ops.format`
  describes.

Quantization (``fmt.scaled``), per (plane, token, head) row ``x`` of ``head_dim``
values, all arithmetic in IEEE float32 (divisions are tensor / tensor so that no
backend rewrites them as a multiplication by a reciprocal)::

    amax  = max |x|
    inv   = 448 / amax          (0 when amax == 0)
    q     = float8_e4m3fn(x * inv)      round to nearest even
    scale = amax / 448
    x'    = float(q) * scale, rounded to the destination dtype (nearest even)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvbridge.ops.format import FP8_MAX, PackedFormat


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def _token_index(
    block_ids: torch.Tensor, num_tokens: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    t = torch.arange(num_tokens, device=block_ids.device)
    return block_ids[t // block_size], t % block_size


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 e4m3 values and float32 scales of ``x`` (..., head_dim), one scale per row."""
    x = x.float()
    amax = x.abs().amax(dim=-1)
    fmax = torch.full_like(amax, FP8_MAX)
    inv = torch.where(amax > 0, fmax / amax, torch.zeros_like(amax))
    q = (x * inv.unsqueeze(-1)).to(torch.float8_e4m3fn)
    return q, amax / fmax


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale.unsqueeze(-1)).to(dtype)


def chunk_views(buf: torch.Tensor, fmt: PackedFormat) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One region's chunks as views: values ``(num_chunks, 2, chunk_tokens, num_heads,
    head_dim)`` and, when scaled, scales ``(num_chunks, 2, chunk_tokens, num_heads)``."""
    n, ct = fmt.num_chunks, fmt.ct
    rows = buf[: n * fmt.chunk_stride].view(n, fmt.chunk_stride)
    values = (
        rows[:, : fmt.values_nbytes]
        .view(_dtype(fmt.dtype))
        .view(n, 2, ct, fmt.num_heads, fmt.head_dim)
    )
    if not fmt.scaled:
        return values, None
    scales = (
        rows[:, fmt.scales_offset : fmt.scales_offset + 8 * ct * fmt.num_heads]
        .view(torch.float32)
        .view(n, 2, ct, fmt.num_heads)
    )
    return values, scales


def _scatter_chunks(dst: torch.Tensor, src: torch.Tensor, ct: int) -> None:
    """``dst[j, :, t] = src[:, j * ct + t]`` for every token ``src`` holds (its dim 1)."""
    total = src.shape[1]
    full = total // ct
    if full:
        dst[:full] = src[:, : full * ct].unflatten(1, (full, ct)).transpose(0, 1)
    if total > full * ct:
        dst[full, :, : total - full * ct] = src[:, full * ct :]


def _gather_chunks(src: torch.Tensor, total: int) -> torch.Tensor:
    """The inverse of :func:`_scatter_chunks`: ``(2, total, ...)`` from chunk views."""
    merged = src.transpose(0, 1).flatten(1, 2)  # (2, num_chunks * ct, ...)
    return merged[:, :total]


def region_rows(buf: torch.Tensor, fmt: PackedFormat) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One region's defined content, chunking undone: values ``(2, num_tokens,
    num_heads, head_dim)`` and scales ``(2, num_tokens, num_heads)`` (or None)."""
    if fmt.num_tokens == 0:
        empty = torch.empty(
            2, 0, fmt.num_heads, fmt.head_dim, dtype=_dtype(fmt.dtype), device=buf.device
        )
        return empty, (torch.empty(2, 0, fmt.num_heads, device=buf.device) if fmt.scaled else None)
    values, scales = chunk_views(buf, fmt)
    vals = _gather_chunks(values, fmt.num_tokens)
    return vals, None if scales is None else _gather_chunks(scales, fmt.num_tokens)


def pack(
    layers: Sequence[tuple[torch.Tensor, torch.Tensor]],
    block_ids: torch.Tensor,
    fmt: PackedFormat,
    head_start: int,
    out: torch.Tensor,
) -> None:
    """Gather tokens ``[0, fmt.num_tokens)`` of heads ``[head_start, head_start +
    fmt.num_heads)`` of every layer's planes into its region of ``out`` (layer ``i`` at
    byte ``i * fmt.nbytes``)."""
    if fmt.num_tokens == 0:
        return
    blk, off = _token_index(block_ids, fmt.num_tokens, layers[0][0].shape[1])
    heads = slice(head_start, head_start + fmt.num_heads)
    for i, (k, v) in enumerate(layers):
        values, scales = chunk_views(out[i * fmt.nbytes :], fmt)
        rows = torch.stack([k[blk, off, heads], v[blk, off, heads]])
        if fmt.scaled:
            q, scale = quantize(rows)
            _scatter_chunks(values, q, fmt.ct)
            _scatter_chunks(scales, scale, fmt.ct)
        else:
            _scatter_chunks(values, rows, fmt.ct)


def unpack(
    packed: torch.Tensor,
    fmt: PackedFormat,
    layers: Sequence[tuple[torch.Tensor, torch.Tensor]],
    block_ids: torch.Tensor,
    head_start: int,
) -> None:
    """Scatter layer ``i``'s region of ``packed`` into tokens ``[0, fmt.num_tokens)`` of
    heads ``[head_start, head_start + fmt.num_heads)`` of ``layers[i]``'s planes,
    converting to their dtype."""
    if fmt.num_tokens == 0:
        return
    blk, off = _token_index(block_ids, fmt.num_tokens, layers[0][0].shape[1])
    heads = slice(head_start, head_start + fmt.num_heads)
    for i, (k, v) in enumerate(layers):
        vals, scales = region_rows(packed[i * fmt.nbytes :], fmt)
        if scales is not None:
            vals = dequantize(vals, scales, k.dtype)
        elif vals.dtype != k.dtype:
            vals = vals.to(k.dtype)
        k[blk, off, heads] = vals[0]
        v[blk, off, heads] = vals[1]


__all__ = ["chunk_views", "dequantize", "pack", "quantize", "region_rows", "unpack"]
