"""The packed wire format: sizes and offsets of one packed region. Pure; no torch.

A *packed region* holds one layer's KV for ``num_tokens`` consecutive tokens of one
request, independent of the cache it came from (layout, where the blocks sit) so that
the receiver may unpack it into a cache of another layout, block size, dtype or head
split. It is a run of *chunks* of ``chunk_tokens`` tokens each (the last may hold
fewer); a chunk is self-contained, so chunk ``j`` of a region can be written and read
on its own (kvbridge streams a request block by block: a chunk is one sender block).
Byte layout of a chunk (little-endian, offsets from the chunk's start; the full
specification with a worked example is ``csrc/PACKED_FORMAT.md``)::

    values   [0, values_nbytes)          element (p, t, h, d) at ((p*CT + t)*H + h)*D + d
    padding  to a 16-byte boundary       (content unspecified)
    scales   [scales_offset, ...)        float32 scale (p, t, h) at (p*CT + t)*H + h;
                                         only when ``scaled``
    padding  to a 16-byte boundary: the next chunk starts at ``chunk_stride``

``p`` is the plane (0 = K, 1 = V), ``t`` the token within the chunk, ``h`` the head
within the packed head range, ``d`` the element within the head, ``CT`` is
``chunk_tokens``. With ``scaled`` the values are float8 e4m3 (``x ~= value * scale``),
one scale per (plane, token, head).

>>> fmt = PackedFormat(num_tokens=40, num_heads=8, head_dim=128, dtype="bfloat16", chunk_tokens=16)
>>> fmt.num_chunks, fmt.chunk_stride, fmt.nbytes
(3, 65536, 196608)
>>> q = PackedFormat(num_tokens=16, num_heads=8, head_dim=128, dtype="float8_e4m3fn", scaled=True)
>>> q.values_nbytes, q.scales_offset, q.nbytes
(32768, 32768, 33792)
"""

from __future__ import annotations

from typing import NamedTuple

from kvbridge.core.layout import DTYPE_SIZES
from kvbridge.errors import PlanError

FP8_DTYPE = "float8_e4m3fn"
FP8_MAX = 448.0
"""Largest finite float8 e4m3fn value; a row's largest magnitude maps to it."""
ALIGN = 16


def _align(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


class PackedFormat(NamedTuple):
    """Shape of one packed region (one layer, ``num_tokens`` tokens, K and V)."""

    num_tokens: int
    num_heads: int
    """KV heads in the region (a slice of the source's heads for a different TP)."""
    head_dim: int
    dtype: str
    """Element type of the values (torch dtype name): the cache's dtype when exact,
    ``float8_e4m3fn`` when quantized (``scaled``) or when the cache itself is FP8."""
    scaled: bool = False
    """Values are FP8 quantized with one float32 scale per (plane, token, head)."""
    chunk_tokens: int = 0
    """Tokens per chunk; 0: one chunk of ``num_tokens``."""

    def check(self) -> None:
        """Raise :class:`PlanError` for an impossible format."""
        for name in ("num_tokens", "num_heads", "head_dim", "chunk_tokens"):
            if getattr(self, name) < 0 or (
                name in ("num_heads", "head_dim") and getattr(self, name) == 0
            ):
                raise PlanError(f"PackedFormat.{name} must be positive, got {getattr(self, name)}")
        if self.dtype not in DTYPE_SIZES:
            raise PlanError(
                f"PackedFormat.dtype {self.dtype!r} is not supported; supported: "
                f"{', '.join(sorted(DTYPE_SIZES))}"
            )
        if self.scaled and self.dtype != FP8_DTYPE:
            raise PlanError(
                f"a scaled (quantized) region holds {FP8_DTYPE} values, not {self.dtype}"
            )

    @property
    def element_size(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def ct(self) -> int:
        """Tokens per chunk, resolved."""
        return self.chunk_tokens or self.num_tokens

    @property
    def num_chunks(self) -> int:
        return -(-self.num_tokens // self.ct) if self.num_tokens else 0

    @property
    def values_nbytes(self) -> int:
        """Bytes of a chunk's values."""
        return 2 * self.ct * self.num_heads * self.head_dim * self.element_size

    @property
    def scales_offset(self) -> int:
        """Where a chunk's scales start, from the chunk's start."""
        return _align(self.values_nbytes)

    @property
    def chunk_stride(self) -> int:
        """Bytes from one chunk to the next (a multiple of 16)."""
        used = (
            self.scales_offset + 8 * self.ct * self.num_heads if self.scaled else self.values_nbytes
        )
        return _align(used)

    @property
    def nbytes(self) -> int:
        """Bytes of the whole region (a multiple of 16); regions of several layers sit
        back to back at this stride."""
        return self.num_chunks * self.chunk_stride


__all__ = ["ALIGN", "FP8_DTYPE", "FP8_MAX", "PackedFormat"]
